"""Scheduler tests with a model-free runner: exact batches, slots, retraction and abort."""

from __future__ import annotations

import random

import pytest

from banyan.cache.no_cache import NoPrefixCache
from banyan.mem.allocator import SlotAllocator
from banyan.sampling.params import SamplingParams
from banyan.scheduler import Request, Scheduler, SchedulerConfig
from banyan.scheduler.builder import BudgetConfig
from banyan.scheduler.memory import DECODE_RUN
from banyan.scheduler.request import FinishReason
from tests.fake_runner import FakeRunner, reference


def make_scheduler(num_slots: int = 1000, max_running: int = 16, prefill: int = 256,
                   chunk: int = 256, max_model_len: int = 512) -> tuple[Scheduler, FakeRunner]:
    runner = FakeRunner(num_slots)
    config = SchedulerConfig(
        max_model_len=max_model_len,
        budget=BudgetConfig(max_running, prefill, chunk),
        check_integrity=True,
    )
    return Scheduler(runner, config, SlotAllocator(num_slots), NoPrefixCache()), runner


def make_request(rid: str, prompt: list[int], max_new: int, eos: int | None = None) -> Request:
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0)
    return Request(rid, list(prompt), params, max_new,
                   eos_ids=frozenset() if eos is None else frozenset({eos}))


def run_all(sched: Scheduler, max_steps: int = 10_000) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_work:
            break
        for u in sched.step():
            outputs.setdefault(u.rid, []).extend(u.new_token_ids)
    assert not sched.has_work, "scheduler did not finish (deadlock?)"
    assert sched.kv.allocator.num_free == sched.kv.capacity, "KV slots leaked"
    return outputs


def random_prompts(n: int, seed: int = 0, max_len: int = 120) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 97) for _ in range(rng.randint(1, max_len))] for _ in range(n)]


def test_first_steps_exact_slots() -> None:
    sched, runner = make_scheduler(num_slots=16, chunk=4, prefill=6)
    sched.add_request(make_request("a", [5, 6, 7, 8, 9], 2))
    sched.add_request(make_request("b", [10, 11], 2))
    sched.step()
    first = runner.batches[0]
    # a gets a 4-token chunk (chunk size), b the remaining budget of 2: the allocator
    # hands out the lowest free slots, 1, 2, 3, ..., in order.
    assert first.rows == [0, 1]
    assert first.prefix_lens == [0, 0]
    assert first.extend_lens == [4, 2]
    assert first.out_slots == [1, 2, 3, 4, 5, 6]
    assert first.sample_indices == [1]  # a's chunk does not reach the end of its prompt
    sched.step()
    second = runner.batches[1]
    # Both need exactly one token: a its last prompt token, b its first decode. One-token work
    # is served first, in admission order. a takes a run for the 2 tokens it will still write
    # (slot 8 is its decode run), b needs only one more.
    assert second.rows == [0, 1]
    assert second.prefix_lens == [4, 2]
    assert second.extend_lens == [1, 1]
    assert second.out_slots == [7, 9]
    assert second.sample_indices == [0, 1]
    sched.step()
    assert runner.batches[2].out_slots == [8]  # a's decode from its run; b has finished


def test_decode_slots_come_in_runs_per_request() -> None:
    """Decoding requests take their slots DECODE_RUN at a time, so each one's K/V stays in
    ascending runs instead of interleaving with the others' step by step."""
    sched, runner = make_scheduler(num_slots=1000)
    for rid in "abc":
        sched.add_request(make_request(rid, [5, 6, 7], 40))
    run_all(sched)
    per_row: dict[int, list[int]] = {}
    for batch in runner.batches:
        for row, n, start in zip(batch.rows, batch.extend_lens, _starts(batch.extend_lens)):
            if n == 1:
                per_row.setdefault(row, []).extend(batch.out_slots[start : start + 1])
    assert len(per_row) == 3
    for slots in per_row.values():
        assert len(slots) == 39  # the outputs fed back (the prompt took one 3-token step)
        runs = [slots[i : i + DECODE_RUN] for i in range(0, len(slots), DECODE_RUN)]
        for run in runs:
            assert run == list(range(run[0], run[0] + len(run)))  # consecutive slots
    assert sched.kv.allocator.num_free == 999  # every decode run came back


def _starts(lens: list[int]) -> list[int]:
    out, at = [], 0
    for n in lens:
        out.append(at)
        at += n
    return out


@pytest.mark.parametrize("chunk,prefill", [(4096, 4096), (16, 40), (7, 7)])
def test_outputs_equal_alone_whatever_the_chunking(chunk: int, prefill: int) -> None:
    prompts = random_prompts(12)
    sched, _ = make_scheduler(chunk=chunk, prefill=prefill, num_slots=4000)
    for i, p in enumerate(prompts):
        sched.add_request(make_request(str(i), p, 5 + i))
    outputs = run_all(sched)
    for i, p in enumerate(prompts):
        assert outputs[str(i)] == reference(p, 5 + i)


def test_retraction_under_memory_pressure_keeps_outputs() -> None:
    prompts = random_prompts(10, seed=1, max_len=40)
    sched, _ = make_scheduler(num_slots=120, chunk=32, prefill=64)
    for i, p in enumerate(prompts):
        sched.add_request(make_request(str(i), p, 40))
    outputs = run_all(sched)
    assert sched.total_retractions > 0
    for i, p in enumerate(prompts):
        assert outputs[str(i)] == reference(p, 40)


def test_requests_arriving_while_others_decode() -> None:
    prompts = random_prompts(8, seed=2)
    sched, _ = make_scheduler(num_slots=2000, chunk=32, prefill=48)
    outputs: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    while pending or sched.has_work:
        if pending:
            i, p = pending.pop(0)
            sched.add_request(make_request(str(i), p, 12))
        for u in sched.step():
            outputs.setdefault(u.rid, []).extend(u.new_token_ids)
    for i, p in enumerate(prompts):
        assert outputs[str(i)] == reference(p, 12)


def test_eos_stops_and_max_new_tokens_zero() -> None:
    prompt = [5, 6, 7]
    expected = reference(prompt, 50)
    eos = expected[3]
    sched, _ = make_scheduler()
    sched.add_request(make_request("eos", prompt, 50, eos=eos))
    sched.add_request(make_request("zero", prompt, 0))
    reasons = {}
    outputs: dict[str, list[int]] = {}
    while sched.has_work:
        for u in sched.step():
            outputs.setdefault(u.rid, []).extend(u.new_token_ids)
            if u.finish_reason:
                reasons[u.rid] = u.finish_reason
    assert outputs["eos"] == expected[: expected.index(eos) + 1]
    assert reasons == {"eos": FinishReason.STOP, "zero": FinishReason.LENGTH}
    assert outputs.get("zero", []) == []


def test_abort_frees_slots_at_once() -> None:
    sched, _ = make_scheduler(num_slots=500, chunk=8, prefill=8)
    sched.add_request(make_request("long", list(range(3, 60)), 100))
    sched.add_request(make_request("other", [4, 5, 6], 10))
    sched.add_request(make_request("queued", [7, 8], 10))
    sched.step()
    sched.step()
    assert sched.kv.allocator.num_free < sched.kv.capacity
    update = sched.abort("long")
    assert update is not None and update.finish_reason is FinishReason.ABORT
    sched.kv.check_integrity(sched.running)
    assert sched.abort("queued") is not None
    assert sched.abort("nope") is None
    outputs = run_all(sched)
    assert outputs["other"] == reference([4, 5, 6], 10)
    assert "long" not in sched.requests


def test_request_that_can_never_fit_is_refused() -> None:
    sched, _ = make_scheduler(num_slots=50)
    with pytest.raises(ValueError, match="never fit"):
        sched.add_request(make_request("big", list(range(3, 40)), 20))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(make_request("empty", [], 5))
    with pytest.raises(ValueError, match="context length"):
        make_scheduler(max_model_len=16)[0].add_request(make_request("x", [3] * 16, 1))
    sched.add_request(make_request("ok", [3, 4], 5))  # the scheduler still serves
    assert run_all(sched)["ok"] == reference([3, 4], 5)


def test_runner_failure_aborts_only_that_step() -> None:
    sched, runner = make_scheduler()
    sched.add_request(make_request("a", [3, 4, 5], 4))
    real_run = runner.run
    runner.run = lambda batch: (_ for _ in ()).throw(RuntimeError("boom"))  # type: ignore[method-assign]
    updates = sched.step()
    assert updates[0].finish_reason is FinishReason.ABORT and "boom" in (updates[0].error or "")
    runner.run = real_run  # type: ignore[method-assign]
    sched.add_request(make_request("b", [3, 4, 5], 4))
    assert run_all(sched)["b"] == reference([3, 4, 5], 4)
