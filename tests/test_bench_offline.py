"""`banyan bench offline` on the tiny model: the step-driven driver runs dependent workloads
(answers into the history), records every request, and adds the engine's step timings up to
the busy/idle split; the CLI writes its JSON and PNG."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from banyan.bench.offline import run_workload
from banyan.bench.workloads import (Workload, agent_workload, multi_turn_workload,
                                    random_workload)
from banyan.engine import Engine


@pytest.fixture(scope="module")
def engine(llama_dir: Path) -> Iterator[Engine]:
    with Engine(model=str(llama_dir), dtype="float32", device="cpu", kv_cache_memory="32MiB",
                disable_tqdm=True) as eng:
        yield eng


@pytest.mark.parametrize("history", ["model", "scripted"])
def test_multi_turn_records_and_reuse(engine: Engine, history: str) -> None:
    engine.flush_cache()
    w = multi_turn_workload(2, 3, 20, 5, 4, engine.core.vocab_size, seed=0)
    res = run_workload(engine, w, history=history, use_tqdm=False)
    records = res["records"]
    lens = w.prompt_lens()
    assert res["failed"] == 0 and len(records) == 6
    for r in records:
        assert r.success and r.finish_reason == "length"
        assert r.prompt_tokens == lens[r.index]  # exact, whichever answer is in the history
        assert r.output_tokens == 4 and len(r.itl) == 3
        assert 0 < r.ttft <= r.latency
        if r.parent is not None:
            parent = records[r.parent]
            assert r.start >= parent.start + parent.latency - 1e-6  # after its previous turn
            assert r.cached_tokens >= parent.prompt_tokens  # the history was reused
    assert res["reusable_tokens"] == w.reusable(history)
    assert 0 < res["hit_rate_vs_optimum"] <= 1.0
    split = res["step_split"]
    assert split["steps"] > 0 and split["forward_s"] > 0
    parts = (split["schedule_s"] + split["prepare_s"] + split["wait_s"] + split["output_s"]
             + split["step_other_s"])
    assert parts == pytest.approx(split["wall_s"], rel=1e-6, abs=1e-6)
    assert split["wall_s"] + split["driver_s"] == pytest.approx(res["elapsed_s"], rel=1e-6)
    assert split["busy_fraction"] + split["idle_fraction"] == pytest.approx(1.0)


def test_agent_and_random(engine: Engine) -> None:
    engine.flush_cache()
    w = agent_workload(2, 3, 30, 5, 4, 3, engine.core.vocab_size, seed=1)
    res = run_workload(engine, w, use_tqdm=False)
    assert res["failed"] == 0 and res["output_tokens"] == 6 * 3
    assert res["prompt_tokens"] == w.prompt_tokens and res["cached_tokens"] > 0
    w = random_workload(5, 16, 4, engine.core.vocab_size, range_ratio=0.5, seed=2)
    res = run_workload(engine, w, use_tqdm=False)
    assert res["output_tokens"] == sum(r.output_len for r in w.requests)
    assert not engine.core.scheduler.requests  # nothing left behind


def test_answers_end_at_eos_only_where_the_workload_says(engine: Engine,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A workload of real tasks (grounded generation) lets the model end its answer; the
    synthetic ones keep exact lengths (ignore_eos)."""
    seen: list[bool] = []
    add = engine.add_request

    def spy(*args: object, **kwargs: object) -> object:
        seen.append(kwargs["params"].ignore_eos)  # type: ignore[union-attr]
        return add(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(engine, "add_request", spy)
    w = random_workload(2, 8, 3, engine.core.vocab_size, seed=3)
    run_workload(engine, w, use_tqdm=False)
    tasks = Workload("tasks", w.requests, stop_at_eos=True)
    res = run_workload(engine, tasks, use_tqdm=False)
    assert seen == [True, True, False, False]
    assert res["failed"] == 0 and 2 <= res["output_tokens"] <= 6
    with pytest.raises(ValueError, match="stop_at_eos"):
        Workload("chained", multi_turn_workload(1, 2, 8, 4, 3, 100, seed=0).requests,
                 stop_at_eos=True)


def test_cli_offline(llama_dir: Path, tmp_path: Path,
                     capsys: pytest.CaptureFixture[str]) -> None:
    from banyan.cli import main

    out, png = tmp_path / "o.json", tmp_path / "o.png"
    code = main(["bench", "offline", "--model", str(llama_dir), "--dtype", "float32",
                 "--kv-cache-memory", "32MiB", "--workload", "shared-prefix", "--groups", "2",
                 "--prompts-per-group", "2", "--system-len", "32", "--question-len", "4",
                 "--output-len", "3", "--disable-tqdm", "--out", str(out), "--plot", str(png)])
    assert code == 0
    assert "Busy: forward + sample" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["result"]["requests"] == 4 and len(data["records"]) == 4
    assert data["result"]["cached_tokens"] >= 2 * 32  # the second prompt of each group
    assert data["machine"]["cores"] and "step_split" in data["result"]
    assert png.read_bytes()[:4] == b"\x89PNG"
