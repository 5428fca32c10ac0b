"""Bursts of decode steps (ForwardBatch.decode_steps, vLLM's multi-step scheduling): the decode
lane runs several decode steps of plain greedy requests in one scheduling. With the model-free
runner: the tokens, text and finish reasons of single steps, through stop tokens and stop
strings inside a burst, length limits, retraction and a prefix cache; no KV slot leaked; the
burst size bounded by the budget; a runner that cannot burst; the batch checks. With the
native layer stack: the engine's outputs with and without bursts, and a draft model's guesses
made in bursts."""

from __future__ import annotations

from pathlib import Path

import pytest

from banyan import Engine
from banyan.args import EngineArgs
from banyan.batch import ForwardBatch, SamplingRow
from banyan.cache.radix import RadixCache
from banyan.kernels import native
from banyan.mem.allocator import SlotAllocator
from banyan.runner.batch_checks import BatchChecks
from banyan.sampling.params import SamplingParams
from banyan.scheduler import Request, Scheduler, SchedulerConfig
from banyan.scheduler.builder import BudgetConfig
from banyan.scheduler.request import FinishReason
from banyan.scheduler.scheduler import BURST_BUDGET_S
from banyan.spec.draft_head import DraftHead
from tests.fake_runner import FakeRunner, reference
from tests.model_helpers import random_ids
from tests.test_scheduler import random_prompts
from tests.test_step_pipeline import _ToyStream


def build(decode_steps: int, num_slots: int = 3000, forward_s: float | None = 0.001,
          bursts: bool = True) -> tuple[Scheduler, FakeRunner]:
    runner = FakeRunner(num_slots, forward_s=forward_s, bursts=bursts)
    allocator = SlotAllocator(num_slots)
    config = SchedulerConfig(max_model_len=400, budget=BudgetConfig(8, 96, 48),
                             check_integrity=True, decode_steps=decode_steps)
    return Scheduler(runner, config, allocator, RadixCache(allocator)), runner  # type: ignore[arg-type]


def add_mix(sched: Scheduler, greedy: bool = True) -> dict[str, tuple[list[int], int, int | None]]:
    """Requests whose stop token (every third) comes half-way, with assorted lengths; some
    share a prompt prefix. -> rid: (prompt, max_new_tokens, stop token)."""
    prompts = random_prompts(14, seed=9, max_len=60)
    prompts += [prompts[0] + p[:5] for p in prompts[1:4]]  # a cached prefix, then their own
    made = {}
    for i, prompt in enumerate(prompts):
        m = 3 + (i * 7) % 45
        eos = reference(prompt, m)[m // 2] if i % 3 == 0 else None
        temperature = 0.0 if greedy or i != 5 else 0.8  # (the fake runner ignores it)
        params = SamplingParams(max_new_tokens=m, temperature=temperature)
        sched.add_request(Request(str(i), prompt, params, m,
                                  eos_ids=frozenset() if eos is None else frozenset({eos}),
                                  text=_ToyStream(4) if i % 2 else None))
        made[str(i)] = (prompt, m, eos)
    return made


def trace(sched: Scheduler) -> dict[str, tuple[list[int], str, FinishReason | None]]:
    """Every request's tokens, text and finish reason, over all its updates (KV checked)."""
    got: dict[str, tuple[list[int], str, FinishReason | None]] = {}
    for _ in range(20_000):
        if not sched.has_work:
            break
        for u in sched.step():
            tokens, text, _ = got.get(u.rid, ([], "", None))
            got[u.rid] = (tokens + list(u.new_token_ids), text + u.text, u.finish_reason)
    assert not sched.has_work
    assert sched.kv.allocator.num_free + sched.kv.cache.evictable_size == sched.kv.capacity, \
        "KV slots leaked"
    return got


@pytest.mark.parametrize("num_slots", [3000, 120], ids=["roomy", "retracting"])
def test_bursts_give_what_single_steps_give(num_slots: int) -> None:
    """Tokens, text and finish reasons of every request equal single steps', stop tokens and
    stop strings ending requests inside bursts; bursts ran, up to their size."""
    runs = {}
    for steps in (1, 4):
        sched, runner = build(steps, num_slots)
        add_mix(sched)
        runs[steps] = trace(sched)
        sizes = [b.decode_steps for b in runner.batches]
        assert max(sizes) == steps and (sizes.count(4) >= 4 or steps == 1)
        if num_slots < 3000:
            assert sched.total_retractions > 0
    assert runs[4] == runs[1]
    reasons = {reason for _, _, reason in runs[1].values()}
    assert {FinishReason.STOP, FinishReason.LENGTH} <= reasons


def test_burst_tokens_equal_the_reference() -> None:
    """Each request's tokens are the reference's, cut at its stop token or its length; the
    stop tokens (and the limits) fall inside bursts, whose later tokens are dropped."""
    sched, runner = build(8)
    made = add_mix(sched)
    got = {rid: tokens for rid, (tokens, _, _) in trace(sched).items()}
    for rid, (prompt, m, eos) in made.items():
        if int(rid) % 2 == 0:  # (odd ones have stop strings)
            assert got[rid] == reference(prompt, m, eos), rid
    # a request's stop token ended a burst early, for every member
    short = [b for b in runner.batches if b.decode_steps > 1 and b.burst_stops]
    assert short


def test_burst_size_follows_the_budget() -> None:
    """Decode steps of 6 ms: bursts of BURST_BUDGET_S // 6 ms; no forward time measured: none."""
    sched, runner = build(8, forward_s=0.006)
    add_mix(sched)
    trace(sched)
    assert max(b.decode_steps for b in runner.batches) == int(BURST_BUDGET_S / 0.006)
    sched, runner = build(8, forward_s=None)
    add_mix(sched)
    trace(sched)
    assert {b.decode_steps for b in runner.batches} == {1}


def test_no_bursts_while_a_member_samples() -> None:
    """A member that is not plain greedy keeps its lane steps to one decode each."""
    sched, runner = build(8)
    add_mix(sched, greedy=False)
    trace(sched)
    for b in runner.batches:
        if b.decode_steps > 1:
            assert all(row.plain for row in b.sampling)
    assert any(not row.plain for b in runner.batches for row in b.sampling)


def test_a_runner_that_runs_one_step_of_a_burst() -> None:
    """A runner answers one token a request for a burst (it cannot run one): the outputs are
    the same, the burst's later slots handed back."""
    single, _ = build(1)
    add_mix(single)
    sched, runner = build(8, bursts=False)
    add_mix(sched)
    assert trace(sched) == trace(single)
    assert max(b.decode_steps for b in runner.batches) == 8


def _burst_batch(steps: int, later: list[int], temperature: float = 0.0) -> ForwardBatch:
    params = SamplingParams(max_new_tokens=9, temperature=temperature)
    return ForwardBatch(rows=[0, 1], prefix_lens=[4, 6], extend_lens=[1, 1], input_ids=[5, 6],
                        out_slots=[10, 11], sample_indices=[0, 1],
                        sampling=[SamplingRow(params, [1], []), SamplingRow(params, [2], [])],
                        decode_steps=steps, later_slots=later)


def test_a_bad_burst_size_is_refused_at_startup() -> None:
    with pytest.raises(ValueError, match="num_scheduler_steps must be >= 1"):
        EngineArgs(num_scheduler_steps=0)


def test_batch_checks_name_a_bad_burst() -> None:
    checks = BatchChecks(max_rows=4, max_context=16)
    checks.check(_burst_batch(3, [12, 13, 14, 15]), num_slots=100, vocab_size=50)
    bad = {"later_slots needs 4": _burst_batch(3, [12, 13, 14]),
           "decode_steps must be >= 1": _burst_batch(0, []),
           "plain greedy": _burst_batch(2, [12, 13], temperature=0.5),
           "later_slots must be in": _burst_batch(2, [12, 100]),
           "past max_context": _burst_batch(11, list(range(12, 32)))}
    for message, batch in bad.items():
        with pytest.raises(ValueError, match=message):
            checks.check(batch, num_slots=100, vocab_size=50)


@pytest.mark.skipif(native.load() is None, reason="native CPU kernels unavailable")
@pytest.mark.parametrize(("arch", "dtype", "quantization"),
                         [("llama", "float32", "none"), ("qwen3", "float32", "none"),
                          ("llama", "bfloat16", "int4")])
def test_engine_bursts_equal_single_steps(model_dirs: dict[str, Path], arch: str, dtype: str,
                                          quantization: str) -> None:
    """The engine with bursts (the layer stack running decode steps back to back) gives every
    request's tokens, text and finish reason of single steps, through a stop token and a stop
    string met inside bursts and length limits; bursts of several steps ran; no slot leaked."""
    prompts = [random_ids(12 + 5 * i, seed=40 + i) for i in range(4)]

    def run(steps: int, params: list[SamplingParams]) -> tuple[list[tuple[object, ...]], int]:
        with Engine(str(model_dirs[arch]), dtype=dtype, quantization=quantization,
                    num_scheduler_steps=steps, kv_cache_memory="32MiB", disable_tqdm=True,
                    linear_kernel="native" if quantization == "none" else "auto") as engine:
            runner = engine.core.scheduler.runner.model_runner
            bursts = 0
            burst = runner.greedy_burst

            def counted(*args: object) -> list[list[int]] | None:
                nonlocal bursts
                tokens = burst(*args)  # type: ignore[arg-type]
                bursts += tokens is not None and len(tokens[0]) > 1
                return tokens

            runner.greedy_burst = counted  # type: ignore[method-assign]
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            kv = engine.core.scheduler.kv
            assert kv.allocator.num_free + kv.cache.evictable_size == kv.capacity
        return [(o.outputs[0].output_ids, o.outputs[0].text, o.outputs[0].finish_reason)
                for o in outs], bursts

    plain = [SamplingParams(max_new_tokens=40 - 3 * i, temperature=0.0, ignore_eos=True)
             for i in range(4)]
    free_run, _ = run(1, plain)
    stop_token = free_run[0][0][17]  # type: ignore[index]
    stop_text = free_run[1][1][10:14]  # type: ignore[index]
    params = [p.copy() for p in plain]
    params[0] = plain[0].copy(stop_token_ids=[stop_token])
    params[1] = plain[1].copy(stop=[stop_text])
    single, none = run(1, params)
    burst, bursts = run(8, params)
    assert none == 0 and bursts >= 5
    assert burst == single
    assert single[0][2] == "stop" and single[3][2] == "length"


@pytest.mark.skipif(native.load() is None, reason="native CPU kernels unavailable")
def test_draft_guesses_in_bursts_equal_one_position_at_a_time(llama_dir: Path) -> None:
    """A bf16 draft (the target itself, its head picked from the 4-bit copy) guessing its
    positions after the first in bursts of decode steps makes the guesses it makes one
    position at a time, step for step, and holds the same tokens' K/V after each; the outputs
    are the same and every draft slot is free."""

    def run(bursts: bool, confidence: float) -> tuple[list[list[int]], list[list[list[int]]],
                                                     int]:
        with Engine(str(llama_dir), dtype="bfloat16", device="cpu", disable_tqdm=True,
                    speculative_algorithm="draft", spec_draft_model=str(llama_dir),
                    spec_draft_min_confidence=confidence, spec_draft_no_lookup=True,
                    speculative_max_step_tokens=64) as engine:
            speculation = engine.core.scheduler.speculation
            # every guess asked for is made: the cut by measured costs is timing, which two
            # runs do not share (a run beside a busy CPU guessed fewer)
            speculation._worth_it = lambda decoding, wanted: wanted  # type: ignore[method-assign]
            proposer = speculation.proposer
            proposer.head = DraftHead.build(proposer.runner.model, proposer.runner.device,
                                            proposer.runner.dtype, min_bytes=0)
            assert proposer.runner.stack is not None and proposer.head is not None
            proposer.bursts = bursts
            made: list[list[list[int]]] = []
            propose, hidden_burst = proposer.propose, proposer.runner.hidden_burst
            ran: list[int] = []

            def recorded(*args: object) -> list[list[int]]:
                guesses = propose(*args)  # type: ignore[arg-type]
                # and the tokens whose K/V the draft now holds, request by request
                made.append([guesses, *(list(seq.tokens) for seq in proposer._seqs.values())])
                return guesses

            def counted(*args: object) -> int | None:
                steps = hidden_burst(*args)  # type: ignore[arg-type]
                ran.append(steps or 0)
                return steps

            proposer.propose = recorded  # type: ignore[method-assign]
            proposer.runner.hidden_burst = counted  # type: ignore[method-assign]
            prompts = [random_ids(30 + 9 * j, seed=70 + j) for j in range(3)]
            outs = engine.generate(input_ids=prompts, sampling_params=[
                SamplingParams(max_new_tokens=30, temperature=0.0) for _ in prompts])
            assert proposer.allocator.num_free == proposer.allocator.capacity
        return [o.outputs[0].output_ids for o in outs], made, max(ran, default=0)

    for confidence in (0.0, 0.014):  # (this model's picks: 0.011-0.022 from 10th to 90th pct)
        single, single_guesses, none = run(False, confidence)
        burst, burst_guesses, longest = run(True, confidence)
        assert none == 0 and longest >= (2 if confidence else 3)
        assert burst_guesses == single_guesses and sum(map(len, sum(single_guesses, []))) > 20
        assert burst == single
