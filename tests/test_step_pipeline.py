"""The step pipeline with the model-free runner: schedule/update split, overlap (step n built
before step n-1's tokens are known), several tokens per request (proposals), failures."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from banyan.batch import ForwardBatch, SamplingRow
from banyan.cache.no_cache import NoPrefixCache
from banyan.cache.radix import RadixCache
from banyan.mem.allocator import SlotAllocator
from banyan.sampling.params import SamplingParams
from banyan.scheduler import Request, Scheduler, SchedulerConfig
from banyan.scheduler.builder import BudgetConfig
from banyan.scheduler.speculation import SpeculationConfig
from banyan.scheduler.request import FinishReason
from tests.fake_runner import FakeRunner, next_token, reference
from tests.test_scheduler import make_request, random_prompts


def build(overlap: bool, num_slots: int = 2000, cache: bool = False, chunk: int = 48,
          proposer: object = None, max_proposed: int = 0,
          max_step_tokens: int = 16) -> tuple[Scheduler, FakeRunner]:
    runner = FakeRunner(num_slots)
    allocator = SlotAllocator(num_slots)
    config = SchedulerConfig(max_model_len=400, budget=BudgetConfig(8, 96, chunk),
                             overlap=overlap, check_integrity=True,
                             speculation=SpeculationConfig(num_tokens=max(max_proposed, 1),
                                                           max_step_tokens=max_step_tokens))
    prefix_cache = RadixCache(allocator) if cache else NoPrefixCache()
    return Scheduler(runner, config, allocator, prefix_cache, proposer), runner  # type: ignore[arg-type]


def drain(sched: Scheduler) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    for _ in range(20_000):
        if not sched.has_work:
            break
        for u in sched.step():
            outputs.setdefault(u.rid, []).extend(u.new_token_ids)
    assert not sched.has_work
    free = sched.kv.allocator.num_free + sched.kv.cache.evictable_size
    assert free == sched.kv.capacity, "KV slots leaked"
    return outputs


@pytest.mark.parametrize("cache", [False, True], ids=["no-cache", "radix"])
@pytest.mark.parametrize("num_slots", [2000, 400], ids=["roomy", "retracting"])
def test_overlap_outputs_equal_reference(cache: bool, num_slots: int) -> None:
    prompts = random_prompts(20, seed=4)
    prompts += [prompts[0][:60] + p for p in prompts[1:5]]  # shared prefixes
    sched, runner = build(overlap=True, num_slots=num_slots, cache=cache)
    for i, p in enumerate(prompts):
        sched.add_request(make_request(str(i), p, 5 + i % 23, eos=None if i % 3 else 7))
    out = drain(sched)
    for i, p in enumerate(prompts):
        assert out[str(i)] == reference(p, 5 + i % 23, None if i % 3 else 7), f"request {i}"
    assert any(b.deferred_inputs for b in runner.batches), "overlap never deferred an input"
    if num_slots == 400:
        assert sched.total_retractions > 0


def test_overlap_schedules_before_tokens_are_known() -> None:
    """Step n+1 is built before step n is collected: its decode input is deferred, and a
    request that reached max_new_tokens is not scheduled again."""
    sched, runner = build(overlap=True)
    sched.add_request(make_request("a", [5, 6, 7], 3))
    sched.step()  # schedules and launches the prefill; nothing collected yet
    assert sched.requests["a"].pending == 1 and sched.requests["a"].output_ids == []
    updates = sched.step()  # launches decode 1 (input deferred), collects the prefill
    assert [u.new_token_ids for u in updates] == [reference([5, 6, 7], 1)]
    assert runner.batches[1].deferred_inputs == [0]
    out = drain(sched)
    assert out["a"] == reference([5, 6, 7], 3)[1:]
    assert len(runner.batches) == 3, "a request was scheduled past max_new_tokens"


def test_eos_under_overlap_drops_the_extra_step_and_frees_once() -> None:
    prompt = [9, 10, 11, 12]
    full = reference(prompt, 30)
    eos = full[4]
    sched, runner = build(overlap=True)
    sched.add_request(make_request("a", prompt, 30, eos=eos))
    sched.add_request(make_request("b", [3, 4], 30))
    out = drain(sched)
    assert out["a"] == full[:5] and out["b"] == reference([3, 4], 30)
    # a was in the step after the one that sampled its EOS (built before the EOS was known)
    rows_with_a = [b for b in runner.batches if b.rows and len(b.rows) == 2]
    assert len(rows_with_a) == 6


def test_abort_while_in_flight() -> None:
    sched, _ = build(overlap=True)
    for i, p in enumerate(random_prompts(6, seed=2)):
        sched.add_request(make_request(str(i), p, 20))
    out: dict[str, list[int]] = {}
    for _ in range(4):
        for u in sched.step():
            out.setdefault(u.rid, []).extend(u.new_token_ids)
    assert sched.abort("2") is not None and sched.abort("4") is not None
    for rid, tokens in drain(sched).items():
        out.setdefault(rid, []).extend(tokens)
    assert len(out.get("2", [])) < 20
    for i, p in enumerate(random_prompts(6, seed=2)):
        if i not in (2, 4):
            assert out[str(i)] == reference(p, 20)


@pytest.mark.parametrize("overlap", [True, False])
def test_failed_step_aborts_its_requests_only(overlap: bool) -> None:
    sched, runner = build(overlap=overlap, cache=True)
    sched.add_request(make_request("a", list(range(3, 80)), 6))
    sched.step()
    runner.fail_next = True
    sched.add_request(make_request("b", [3, 4, 5], 6))
    outs = drain(sched)
    assert outs.get("a") is not None
    # a repeat of a prompt whose step failed gets the reference (no garbage K/V was cached)
    sched.add_request(make_request("c", list(range(3, 80)), 6))
    sched.add_request(make_request("d", [3, 4, 5], 6))
    outs = drain(sched)
    assert outs["c"] == reference(list(range(3, 80)), 6)
    assert outs["d"] == reference([3, 4, 5], 6)


class ReferenceProposer:
    """Proposes the reference continuation with every `wrong`-th guess spoiled."""

    def __init__(self, wrong: int) -> None:
        self.wrong = wrong
        self.calls = 0

    def propose(self, reqs: Sequence[Request], max_tokens: Sequence[int]) -> list[list[int]]:
        return [self._guess(req, k) for req, k in zip(reqs, max_tokens, strict=True)]

    def _guess(self, req: Request, max_tokens: int) -> list[int]:
        self.calls += 1
        context = req.all_ids()
        guess = []
        for j in range(max_tokens):
            t = next_token(context)
            if self.wrong and (self.calls + j) % self.wrong == 0:
                t = 3 + (t - 3 + 1) % 94  # another id in the fake vocabulary
            guess.append(t)
            context = context + [t]
        return guess

    def forget(self, req: Request) -> None:
        pass

    def seconds_per_position(self, requests: int) -> float:
        return 0.0


@pytest.mark.parametrize("wrong", [0, 3, 1])
def test_proposals_keep_outputs_and_hand_back_slots(wrong: int) -> None:
    prompts = random_prompts(10, seed=9)
    proposer = ReferenceProposer(wrong)
    sched, runner = build(overlap=False, proposer=proposer, max_proposed=4, cache=True)
    for i, p in enumerate(prompts):
        sched.add_request(make_request(str(i), p, 3 + 2 * i))
    out = drain(sched)
    for i, p in enumerate(prompts):
        assert out[str(i)] == reference(p, 3 + 2 * i)
    produced = sum(len(v) for v in out.values())
    decode_steps = len([b for b in runner.batches if b.proposed and any(b.proposed)])
    if wrong == 0:  # all accepted: k + 1 tokens per verify step
        assert decode_steps < produced / 3
    assert any(len(p) == 4 for b in runner.batches for p in b.proposed)


def test_stop_inside_accepted_proposals_drops_the_rest() -> None:
    prompt = [20, 21, 22]
    full = reference(prompt, 40)
    eos = full[6]
    sched, _ = build(overlap=False, proposer=ReferenceProposer(0), max_proposed=5)
    sched.add_request(make_request("a", prompt, 40, eos=eos))
    out = drain(sched)
    assert out["a"] == full[:7]
    assert sched.kv.allocator.num_free == sched.kv.capacity


def test_update_rejects_a_mismatched_output() -> None:
    from banyan.batch import StepOutput

    sched, _ = build(overlap=False)
    sched.add_request(make_request("a", [3, 4], 4))
    step = sched.schedule()
    with pytest.raises(RuntimeError, match="rows"):
        sched.update(step, StepOutput(sampled_token_ids=[], logprobs=[]))


def test_random_mix_under_overlap_and_aborts() -> None:
    rng = random.Random(11)
    sched, _ = build(overlap=True, num_slots=500, cache=True, chunk=17)
    expected: dict[str, list[int]] = {}
    got: dict[str, list[int]] = {}
    aborted: set[str] = set()
    n = 0
    for turn in range(400):
        if n < 40 and rng.random() < 0.3:
            p = [rng.randrange(3, 97) for _ in range(rng.randint(1, 90))]
            if rng.random() < 0.5:
                p = [5, 6, 7, 8] * 10 + p
            m = rng.randint(1, 25)
            sched.add_request(make_request(f"r{n}", p, m))
            expected[f"r{n}"] = reference(p, m)
            n += 1
        if sched.requests and rng.random() < 0.03:
            rid = rng.choice(sorted(sched.requests))
            sched.abort(rid)
            aborted.add(rid)
        for u in sched.step():
            got.setdefault(u.rid, []).extend(u.new_token_ids)
            if u.finish_reason is FinishReason.ABORT:
                aborted.add(u.rid)
    got_rest = drain(sched)
    for rid, toks in got_rest.items():
        got.setdefault(rid, []).extend(toks)
    for rid, want in expected.items():
        if rid in aborted:
            assert got.get(rid, []) == want[: len(got.get(rid, []))]
        else:
            assert got[rid] == want, rid


def _sampler_view(row: SamplingRow) -> tuple[object, ...]:
    """What the sampler reads of a row: its history only when its parameters read it (a row
    that reads none is made once and reused, batch.py)."""
    history = (row.output_ids, row.num_output, row.pending) if row.params.reads_history else ()
    return (row.params, row.prompt_ids, row.seed, row.row, row.grammar, *history)


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
def test_decode_hot_path_builds_the_batches_the_general_one_does(
        overlap: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """BatchBuilder._add_decodes (every running decode at once) against _add one request at a
    time: the same batches, through retractions, a prefix cache, penalties and seeds."""

    def batches(general: bool) -> tuple[list[ForwardBatch], int]:
        sched, runner = build(overlap=overlap, num_slots=300, cache=True, chunk=17)
        if general:
            builder = sched.builder
            monkeypatch.setattr(builder, "_add_decodes", lambda step, reqs: [
                builder._add(step, req, 1) for req in reqs])
        rng = random.Random(5)
        for i in range(30):
            prompt = [rng.randrange(3, 97) for _ in range(rng.randint(1, 60))]
            m = rng.randint(1, 30)
            params = SamplingParams(max_new_tokens=m, temperature=0.0,
                                    seed=7 if i % 3 == 0 else None,
                                    presence_penalty=0.5 if i % 4 == 0 else 0.0,
                                    min_new_tokens=min(m, 3) if i % 5 == 0 else 0)
            sched.add_request(Request(str(i), prompt, params, m))
        drain(sched)
        return runner.batches, sched.total_retractions

    (fast, retracted), (general, _) = batches(False), batches(True)
    assert retracted > 0 and len(fast) == len(general) > 30
    assert any(b.deferred_inputs for b in fast) == overlap
    for a, b in zip(fast, general, strict=True):
        assert (a.rows, a.prefix_lens, a.extend_lens, a.input_ids, a.out_slots,
                a.sample_indices, a.deferred_inputs, a.row_prefixes) == (
            b.rows, b.prefix_lens, b.extend_lens, b.input_ids, b.out_slots,
            b.sample_indices, b.deferred_inputs, b.row_prefixes)
        assert [_sampler_view(r) for r in a.sampling] == [_sampler_view(r) for r in b.sampling]


class _ToyStream:
    """A stateful text stream for the scheduler alone: a token's text is its number; a token
    divisible by 11 completes a "stop string" once min_tokens tokens were pushed (its text
    withheld); finish() releases a marker, as held-back text would be."""

    def __init__(self, min_tokens: int) -> None:
        self.pushed, self.min_tokens = 0, min_tokens

    def push_text(self, token_id: int) -> tuple[str, bool]:
        self.pushed += 1
        if token_id % 11 == 0 and self.pushed >= self.min_tokens:
            return "", True
        return f"{token_id} ", False

    def finish(self) -> str:
        return "<held>"


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
def test_inline_decode_updates_equal_the_general_path(
        overlap: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Scheduler._update_decodes applies the usual decode token inline; every update (tokens,
    text, finish reason) must equal what sampled_update makes of it, through stop tokens, stop
    strings, min_new_tokens, length limits and retractions."""
    import banyan.scheduler.scheduler as scheduler_module

    inline_made = 0
    made_by = scheduler_module.RequestUpdate

    def counted(*args: object, **kwargs: object) -> object:  # (updates made in scheduler.py)
        nonlocal inline_made
        inline_made += 1
        return made_by(*args, **kwargs)

    monkeypatch.setattr(scheduler_module, "RequestUpdate", counted)

    def updates(inline: bool) -> list[tuple[object, ...]]:
        sched, _ = build(overlap=overlap, num_slots=300, chunk=17)
        sched.inline_decode_updates = inline
        rng = random.Random(11)
        for i in range(30):
            prompt = [rng.randrange(3, 97) for _ in range(rng.randint(1, 60))]
            m = rng.randint(1, 40)
            params = SamplingParams(max_new_tokens=m, temperature=0.0,
                                    min_new_tokens=min(m, 4) if i % 4 == 0 else 0)
            sched.add_request(Request(str(i), prompt, params, m, eos_ids=frozenset({
                rng.randrange(3, 97)}) if i % 3 == 0 else frozenset(),
                text=_ToyStream(params.min_new_tokens)))
        seen = []
        for _ in range(5000):
            if not sched.has_work:
                break
            seen += [(u.rid, list(u.new_token_ids), u.text, u.finish_reason, u.prompt_tokens)
                     for u in sched.step()]
        assert not sched.has_work
        return seen

    general = updates(False)
    assert inline_made == 0
    fast = updates(True)
    assert inline_made > 50  # the inline path ran
    assert fast == general
    reasons = {u[3] for u in general}
    assert {FinishReason.STOP, FinishReason.LENGTH} <= reasons


class _ToyManyStream:
    """A toy stream that never stops, of a kind that pushes many streams at once (what the
    byte-level stream offers the decode lane): text tells the token and its place."""

    def __init__(self) -> None:
        self.pushed = 0

    def push_text(self, token_id: int) -> tuple[str, bool]:
        self.pushed += 1
        return f"{token_id}@{self.pushed} ", False

    def finish(self) -> str:
        return "<end>"

    @staticmethod
    def push_many(streams: Sequence[_ToyManyStream], tokens: Sequence[int]) -> list[str]:
        return [s.push_text(t)[0] for s, t in zip(streams, tokens, strict=True)]


@pytest.mark.parametrize(("num_slots", "streams"), [(2000, "mixed"), (100, "mixed"),
                                                    (2000, "many")],
                         ids=["roomy", "retracting", "push-many"])
def test_decode_lane_equals_the_general_path(num_slots: int, streams: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Steady decode steps through the decode lane against the general path: the same batches
    and the same updates (tokens, text, finish reasons), through stop tokens, stop strings,
    length limits, requests whose sampling reads history (the lane steps aside), arrivals,
    requests waiting for a place, aborts, retractions and a prefix cache; the lane must have
    taken many decode steps."""

    def trace(lane: bool) -> tuple[list[tuple[object, ...]], list[tuple[object, ...]], int]:
        sched, runner = build(overlap=False, num_slots=num_slots, cache=True, chunk=17)
        sched.use_decode_lane = lane
        lane_steps = lane_while_waiting = 0
        build_step = sched.lane.build

        def counted(running: list[Request], burst: int = 1) -> object:
            nonlocal lane_steps, lane_while_waiting
            step = build_step(running, burst)
            lane_steps += step is not None
            lane_while_waiting += step is not None and bool(sched.waiting)
            return step

        sched.lane.build = counted  # type: ignore[method-assign]
        rng = random.Random(3)
        seen: list[tuple[object, ...]] = []

        prompts: dict[str, list[int]] = {}
        generated: dict[str, list[int]] = {}

        def add(i: int) -> None:
            prompt = [rng.randrange(3, 97) for _ in range(rng.randint(1, 50))]
            done = sorted(rid for rid in prompts if rid not in sched.requests)
            if i >= 100 and done:  # a follow-up turn: reuses a finished request's whole KV
                prompt = prompts[done[0]] + generated.get(done[0], []) + prompt[:3]
            prompts[str(i)] = prompt
            m = rng.randint(1, 60)
            params = SamplingParams(max_new_tokens=m, temperature=0.0,
                                    seed=7 if i == 130 else None)  # the lane steps aside
            # an EOS the request will sample half-way (unless something ends it before)
            eos = frozenset(reference(prompt, m)[m // 2 : m // 2 + 1]) if i % 3 == 0 else None
            sched.add_request(Request(str(i), prompt, params, m, eos_ids=eos or frozenset(),
                                      text=_ToyManyStream() if streams == "many"
                                      else _ToyStream(0) if i % 2 else None))

        for i in range(11):  # (8 run at most: some wait while the lane runs)
            add(i)
        for turn in range(5000):
            if not sched.has_work:
                break
            if turn in (12, 13, 30, 45):  # arrivals while the lane runs
                add(100 + turn)
            if turn == 35 and sched.running:
                aborted = sched.abort(sched.running[len(sched.running) // 2].rid)
                assert aborted is not None
                seen.append((aborted.rid, [], aborted.text, aborted.finish_reason,
                             aborted.prompt_tokens, aborted.cached_tokens))
            for u in sched.step():
                generated.setdefault(u.rid, []).extend(u.new_token_ids)
                seen.append((u.rid, list(u.new_token_ids), u.text, u.finish_reason,
                             u.prompt_tokens, u.cached_tokens))
        assert not sched.has_work
        assert sum(u[5] for u in seen) > 0  # follow-up turns found their KV cached
        batches = [(b.rows, b.prefix_lens, b.extend_lens, b.input_ids, b.out_slots,
                    b.sample_indices, b.row_prefixes, [_sampler_view(r) for r in b.sampling])
                   for b in runner.batches]
        assert lane_while_waiting > 0 or not lane or num_slots < 2000  # (8 places taken)
        # (follow-ups sharing a prefix ran in the lane: FakeRunner checked the bound there)
        assert any(b.max_shared_prefix for b in runner.batches) or not lane \
            or num_slots < 2000 or streams == "many"
        assert sched.total_retractions > 0 or num_slots == 2000
        return batches, seen, lane_steps  # type: ignore[return-value]

    many = _ToyManyStream.push_many
    calls = 0

    def counted_many(*args: object) -> list[str]:
        nonlocal calls
        calls += 1
        return many(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(_ToyManyStream, "push_many", staticmethod(counted_many))
    general_batches, general, none = trace(False)
    assert calls == 0
    lane_batches, fast, lane_steps = trace(True)
    assert none == 0 and lane_steps > 10
    # one call per lane step that sampled no stop token (those go to the general path)
    assert (lane_steps // 2 < calls <= lane_steps) if streams == "many" else calls == 0
    assert lane_batches == general_batches
    assert fast == general
    assert {FinishReason.STOP, FinishReason.LENGTH} <= {u[3] for u in general}
