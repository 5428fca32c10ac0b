"""KV cache sizing from a warm-up step's peak memory (banyan/runner/kv_sizing.py).

No GPU here: the CUDA path's arithmetic and order of memory reads are checked with a fake
`MemoryProbe`, the warm-up step itself runs on CPU through the ModelRunner when a probe is
given. The CUDA allocator's own figures are only read by the test marked cuda.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from banyan.batch import ForwardBatch
from banyan.mem.kv_pool import kv_bytes_per_slot
from banyan.models.config import ModelConfig
from banyan.runner.kv_sizing import kv_budget, measure_peak, size_by_warmup, warmup_batch
from banyan.runner.model_runner import ModelRunner
from tests.model_helpers import VOCAB

MIB = 2**20


class FakeProbe:
    """A device of `free` bytes whose steps allocate `step_peak` bytes at their peak: each
    read is logged in `events`, so a test can check what was read when."""

    def __init__(self, free: int, step_peak: int, resident: int = 1000) -> None:
        self.free, self.step_peak, self.resident = free, step_peak, resident
        self.events: list[str] = []

    def free_bytes(self) -> int:
        self.events.append("free")
        return self.free

    def allocated_bytes(self) -> int:
        self.events.append("allocated")
        return self.resident

    def reset_peak(self) -> None:
        self.events.append("reset")

    def peak_bytes(self) -> int:
        self.events.append("peak")
        return self.resident + self.step_peak

    def release_cached(self) -> None:
        self.events.append("release")


def test_budget_sets_the_peak_aside_then_takes_the_fraction() -> None:
    free = 1000 * MIB
    assert kv_budget(free, 0, 0.5) == 500 * MIB
    # the budget shrinks by the peak times the fraction: the fraction is of what is left
    assert kv_budget(free, 200 * MIB, 0.5) == 400 * MIB
    assert kv_budget(free, 200 * MIB, 0.25) == 200 * MIB


def test_peak_over_free_is_a_clear_error() -> None:
    for peak in (1000 * MIB, 1200 * MIB):  # nothing left, and less than nothing
        with pytest.raises(ValueError, match=r"--mem-fraction.*--max-prefill-tokens") as err:
            kv_budget(1000 * MIB, peak, 0.5)
        assert f"{peak / MIB:.1f} MiB" in str(err.value) and "1000.0 MiB free" in str(err.value)


def test_measure_peak_is_above_the_allocation_before_the_step() -> None:
    probe = FakeProbe(free=10**9, step_peak=300, resident=5000)
    assert measure_peak(probe, lambda: probe.events.append("step")) == 300
    assert probe.events == ["allocated", "reset", "step", "peak"]
    # an allocator that reports less than the base (it cannot) still gives no negative peak
    probe.step_peak = -10
    assert measure_peak(probe, lambda: None) == 0


def test_size_by_warmup_reads_free_memory_after_the_warmup() -> None:
    probe = FakeProbe(free=1000 * MIB, step_peak=0)

    def warm_up() -> int:
        probe.events.append("warm-up")
        probe.free -= 10 * MIB  # something the warm-up keeps (compiled kernels, say)
        return 190 * MIB

    sizing = size_by_warmup(probe, 0.5, 4096, warm_up)
    assert probe.events == ["allocated", "warm-up", "release", "free"]
    assert (sizing.free_after, sizing.activation_peak) == (990 * MIB, 190 * MIB)
    assert sizing.budget == 400 * MIB and sizing.warmup_tokens == 4096


def test_warmup_batch_is_the_largest_step() -> None:
    b = warmup_batch(10, 4, max_rows=5, max_context=64, vocab=VOCAB)
    assert b.extend_lens == [4, 4, 2, 1, 1]  # chunks, then a decode in every other row
    assert b.rows == [0, 1, 2, 3, 4] and b.prefix_lens == [0] * 5
    assert b.out_slots == list(range(1, 13)) and b.num_tokens == 12
    assert b.sample_indices == [0, 1, 2, 3, 4]
    assert max(b.input_ids) < VOCAB
    # no more chunks than rows, and no chunk longer than a row
    assert warmup_batch(10, 4, max_rows=2, max_context=64, vocab=VOCAB).extend_lens == [4, 4]
    assert warmup_batch(10, 8, max_rows=3, max_context=5, vocab=VOCAB).extend_lens == [5, 5, 1]
    with pytest.raises(ValueError):
        warmup_batch(0, 4, max_rows=2, max_context=64, vocab=VOCAB)


def _runner(path: Path, probe: FakeProbe | None, **kw: Any) -> ModelRunner:
    args: dict[str, Any] = dict(dtype="float32", mem_fraction=0.5, max_rows=4, max_context=64,
                                show_progress=False, warmup_tokens=40, warmup_chunk=16,
                                memory_probe=probe)
    args.update(kw)
    return ModelRunner(path, **args)


def _step(runner: ModelRunner) -> torch.Tensor:
    ids = list(range(3, 23))
    return runner.forward(ForwardBatch(rows=[1], prefix_lens=[0], extend_lens=[20],
                                       input_ids=ids, out_slots=list(range(5, 25)),
                                       sample_indices=[0]))


def test_runner_sizes_the_pool_after_a_warmup_step(llama_dir: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = ModelConfig.from_pretrained(llama_dir)
    per_slot = kv_bytes_per_slot(cfg.layers, cfg.kv_heads, cfg.head_dim, torch.float32)
    peak = 3 * MIB
    probe = FakeProbe(free=peak + 2 * 100 * per_slot, step_peak=peak)
    steps: list[ForwardBatch] = []
    prepare = ModelRunner.prepare

    def spy(self: ModelRunner, batch: ForwardBatch) -> Any:
        steps.append(batch)
        probe.events.append(f"step over {self.num_slots} slots")
        return prepare(self, batch)

    monkeypatch.setattr(ModelRunner, "prepare", spy)
    runner = _runner(llama_dir, probe)
    # (free - peak) x 0.5 holds 100 slots: under the cap of max_rows x max_context + 1
    assert runner.num_slots == 100
    assert runner.kv_sizing is not None and runner.kv_sizing.activation_peak == peak
    # one warm-up step, 40 prompt tokens in chunks of 16 and 1 decode, over a pool of 42 slots,
    # between the peak's reset and read; free memory read once it is gone
    (batch,) = steps
    assert batch.extend_lens == [16, 16, 8, 1]
    assert probe.events == ["allocated", "allocated", "reset", "step over 42 slots", "peak",
                            "release", "free"]
    assert runner.pool.num_slots == 100 and runner.backend.pool is runner.pool
    # the warm-up leaves nothing behind that a step sees
    monkeypatch.setattr(ModelRunner, "prepare", prepare)
    plain = _runner(llama_dir, None, mem_fraction=None, num_slots=100)
    assert torch.equal(_step(runner), _step(plain))


def test_runner_refuses_a_warmup_peak_over_free_memory(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="--mem-fraction"):
        _runner(llama_dir, FakeProbe(free=2 * MIB, step_peak=3 * MIB))


def test_runner_reports_a_warmup_step_that_does_not_fit(llama_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    def out_of_memory(self: ModelRunner, inputs: object) -> Any:
        raise torch.OutOfMemoryError("CUDA out of memory (fake)")

    monkeypatch.setattr(ModelRunner, "compute", out_of_memory)
    with pytest.raises(RuntimeError, match=r"warm-up step of 41 tokens.*--max-prefill-tokens"):
        _runner(llama_dir, FakeProbe(free=10 * MIB, step_peak=0))


def test_cpu_sizing_runs_no_warmup(llama_dir: Path) -> None:
    runner = _runner(llama_dir, None, max_context=32)  # no probe on CPU: free memory as before
    assert runner.kv_sizing is None and runner.num_slots == 4 * 32 + 1


def test_engine_args_pass_the_largest_step(monkeypatch: pytest.MonkeyPatch,
                                           llama_dir: Path) -> None:
    from banyan.args import EngineArgs

    seen: dict[str, Any] = {}

    def init(self: ModelRunner, path: Path, **kw: Any) -> None:
        seen.update(kw)

    monkeypatch.setattr(ModelRunner, "__init__", init)
    args = EngineArgs(model=str(llama_dir), max_prefill_tokens=3000, chunked_prefill_size=1000,
                      disable_tqdm=True)
    ModelRunner.from_engine_args(args)
    assert (seen["warmup_tokens"], seen["warmup_chunk"]) == (3000, 1000)


@pytest.mark.cuda
def test_cuda_warmup_measures_activations(llama_dir: Path) -> None:
    runner = ModelRunner(llama_dir, dtype="float32", device="cuda", mem_fraction=0.01,
                         max_rows=8, max_context=1024, show_progress=False,
                         warmup_tokens=2048, warmup_chunk=512)
    sizing = runner.kv_sizing
    assert sizing is not None and sizing.activation_peak > 0
    assert sizing.budget == int((sizing.free_after - sizing.activation_peak) * 0.01)
    assert runner.num_slots == min(sizing.budget // runner.bytes_per_token, 8 * 1024 + 1)
