"""The speculation controller and the n-gram lookup, model-free: which decodes get guesses and
how many (step fill, back-off, pauses and probes), priced by the measured step and proposer
costs, prices that one slow step cannot freeze; prompt lookup's matches; a batch too big for
any guess built as without speculation."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from banyan import SamplingParams
from banyan.scheduler import Request
from banyan.scheduler.speculation import (EXPLORE, PROBE_EVERY, Speculation, SpeculationConfig,
                                         StepCost)
from banyan.spec.ngram import NgramProposer
from tests.fake_runner import reference
from tests.test_scheduler import make_request, random_prompts
from tests.test_step_pipeline import ReferenceProposer, build, drain


class EchoProposer:
    """Guesses `token` k times; counts calls; each guessed position costs `seconds`."""

    def __init__(self, token: int = 5, seconds: float = 0.0) -> None:
        self.token, self.calls, self.forgotten, self.seconds = token, 0, [], seconds

    def propose(self, reqs: Sequence[Request], max_tokens: Sequence[int]) -> list[list[int]]:
        self.calls += 1
        return [[self.token] * k for k in max_tokens]

    def forget(self, req: Request) -> None:
        self.forgotten.append(req.rid)

    def seconds_per_position(self, requests: int) -> float:
        return self.seconds


def _req(rid: str) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_new_tokens=100), 100)


def test_controller_fills_small_steps_only_and_backs_off() -> None:
    spec = Speculation(EchoProposer(), SpeculationConfig(num_tokens=4, max_step_tokens=10,
                                                         cooldown=3))
    a, b = _req("a"), _req("b")
    assert spec.plan([a, b], free_slots=100) == [[5] * 4, [5] * 4]
    assert spec.plan([a, b], free_slots=3) == [[5] * 3, []]  # no slot for a guess: no guess
    assert spec.plan([_req(str(i)) for i in range(10)], free_slots=100) == [[]] * 10  # too big
    # b's guesses all fail: fewer, then none for `cooldown` steps, then one probe.
    spec.record(b, 4, 0)
    assert len(spec.plan([b], 100)[0]) == 2
    spec.record(b, 2, 0)
    assert len(spec.plan([b], 100)[0]) == 1
    spec.record(b, 1, 0)
    assert [len(spec.plan([b], 100)[0]) for _ in range(3)] == [0, 0, 1]
    spec.record(a, 4, 4)
    assert len(spec.plan([a], 100)[0]) == 4
    assert spec.stats.num_drafts == 4 and spec.stats.accepted_per_pos == [1, 1, 1, 1]
    assert spec.stats.mean_acceptance_length == pytest.approx(1 + 4 / 4)
    spec.forget(a)
    assert "a" not in spec._state and spec.proposer.forgotten == ["a"]


def test_a_costly_proposer_guesses_only_where_its_forwards_pay() -> None:
    """A draft model's forward per guessed position counts in the price: alone, every guess
    pays; four requests at once (their decodes as cheap as one, every guessed token dear) get
    none and the draft does not run; a request cut for the cost keeps its rate, so that alone
    again its probe is priced at that rate, and taken; alone, one priced out guesses again a
    few steps later."""
    echo = EchoProposer(seconds=0.003)
    spec = Speculation(echo, SpeculationConfig(num_tokens=4, max_step_tokens=64, cooldown=2))
    for tokens in range(1, 21):
        spec.observe_step(tokens, 0.011 + 0.003 * max(0, tokens - 5))
    assert [len(g) for g in spec.plan([_req("fresh")], 100)] == [4]  # 5 tokens in 23 ms
    batch = [_req(str(i)) for i in range(4)]
    for r in batch:
        spec.record(r, 4, 2)  # rate 0.75: 3 guesses wanted each
    calls = echo.calls
    assert spec.plan(batch, 100) == [[]] * 4 and echo.calls == calls  # 4 in 11 ms beats all
    # paused, then a probe priced at the rate kept (0.75): alone, it pays
    assert [len(spec.plan([batch[0]], 100)[0]) for _ in range(2)] == [0, 1]
    # alone, a request priced out (its rate halved by a bad check) is not paused: its rate
    # creeps back up until guessing pays again
    b = batch[1]
    spec.record(b, 4, 0)
    spec.record(b, 4, 0)  # 0.1875
    sizes = [len(spec.plan([b], 100)[0]) for _ in range(12)]
    assert sizes[0] == 0 and sizes[-1] > 0 and echo.calls > calls
    # no plain step of 8 timed yet (only checks of 16): none guessed until one is
    fresh = Speculation(EchoProposer(seconds=0.003), SpeculationConfig(num_tokens=4))
    fresh.observe_step(16, 0.02)
    eight = [_req(f"e{i}") for i in range(8)]
    assert fresh.plan(eight, 100) == [[]] * 8


@pytest.mark.parametrize("tokens,k,want", [
    ([1, 2, 3, 4, 5, 6, 1, 2, 3], 3, [4, 5, 6]),
    ([7, 1, 2, 3, 4, 9, 1, 2], 5, [3, 4, 9, 1, 2]),  # longest suffix first, then [1, 2]
    ([256, 1, 0, 0, 1, 256, 1], 5, [0, 0, 1, 256, 1]),  # byte patterns straddling ids: skipped
    ([5, 5, 5, 5, 5, 5, 5, 5], 3, [5, 5, 5]),  # a run: the latest match with k tokens after it
    ([1, 2, 9, 1, 2, 8, 1, 2], 1, [8]),  # the most recent match
    ([5, 6], 3, []),
])
def test_ngram_lookup(tokens: list[int], k: int, want: list[int]) -> None:
    assert NgramProposer(2, 4).lookup(tokens[:3], tokens[3:], k) == want


def test_guesses_follow_the_measured_step_cost() -> None:
    """A step takes the number of guesses that gives it the most expected tokens per second at
    the measured cost of each step size: all of them where checking is nearly free, the likely
    ones where each token costs, none where a check costs more than it brings; a size never
    seen is tried; nothing changes before any step is timed."""
    def planned(cost: dict[int, float], n: int = 1, halved: bool = False) -> list[int]:
        spec = Speculation(EchoProposer(), SpeculationConfig(num_tokens=4, max_step_tokens=64))
        for tokens, seconds in cost.items():
            spec.observe_step(tokens, seconds)
        reqs = [_req(str(i)) for i in range(n)]
        if halved:
            for r in reqs:
                spec.record(r, 4, 0)  # guesses accepted at rate 0.5 from now on: 2 wanted
        return [len(g) for g in spec.plan(reqs, free_slots=100)]

    flat = {t: 0.020 for t in range(1, 11)}
    assert planned(flat, n=2) == [4, 4]
    assert planned(flat, n=2, halved=True) == [2, 2]
    # a 1-token step on a fast path, checks slower but each guess nearly free (the f32 case)
    stepped = {1: 0.025, **{t: 0.035 + 0.001 * t for t in range(2, 6)}}
    assert planned(stepped) == [4]
    # rate 0.5 (2 guesses wanted, 0.5 token each): at 4 ms + 1 ms a token both pay (2 tokens
    # in 7 ms beats 1 in 5 ms); at 4 ms + 4 ms a token neither does (1.5 in 12 ms, 2 in 16 ms
    # against 1 in 8 ms)
    assert planned({t: 0.004 + 0.001 * t for t in range(1, 6)}, halved=True) == [2]
    assert planned({t: 0.004 + 0.004 * t for t in range(1, 6)}, halved=True) == [0]
    # one guess of two requests pays where a second would not: 2 decodes at 10 ms, 3 tokens
    # (one guess) 11 ms, 4 tokens 20 ms; rate 0.5 each
    assert sorted(planned({2: 0.010, 3: 0.011, 4: 0.020}, n=2, halved=True)) == [0, 1]
    assert planned({1: 0.01}) == [4]  # larger steps never seen: priced as one, so tried
    assert planned({}) == [4]  # nothing timed yet: as configured
    # a request whose guesses are cut pauses like a failing one, then probes with one guess
    # that is not cut (its rate can only be measured by guessing)
    spec = Speculation(EchoProposer(), SpeculationConfig(num_tokens=4, cooldown=2))
    for tokens in range(1, 6):
        spec.observe_step(tokens, 0.004 + 0.004 * tokens)
    a = _req("a")
    spec.record(a, 4, 0)
    # cut (0), paused (0), probe (1); unrecorded, it stays a probe (1)
    assert [len(spec.plan([a], 100)[0]) for _ in range(4)] == [0, 0, 1, 1]


def test_a_slow_moment_does_not_price_a_size_out_for_good() -> None:
    """A size is priced at the median of its last steps, never above a larger size seen (a
    bigger step does more work); with a costly proposer every EXPLORE-th guessing step takes
    one guess more than priced, and a request alone and priced out guesses 2 every
    PROBE_EVERY steps, so that a price set in a slow moment is measured again."""
    cost = StepCost()
    for tokens, ms in ((1, 10), (1, 90), (1, 11), (5, 11), (7, 30), (9, 13)):
        cost.observe(tokens, ms / 1000)
    assert cost.at(1) == pytest.approx(0.011)  # one stalled step of 90 ms: not the price
    assert cost.at(7) == cost.at(8) == pytest.approx(0.013)  # 7's 30 ms was noise
    assert cost.at(6) == pytest.approx(0.011)  # not seen: the size below, to be tried
    for _ in range(StepCost.WINDOW // 2 + 1):
        cost.observe(9, 0.02)
    assert cost.at(9) == pytest.approx(0.02)  # a lasting change is followed
    spec = Speculation(EchoProposer(seconds=0.003), SpeculationConfig(num_tokens=8))
    for tokens in range(1, 9):
        spec.observe_step(tokens, 0.010 + 0.0002 * tokens)
    spec.observe_step(9, 0.050)  # 8 guesses checked once, while the machine was busy
    sizes = [len(spec.plan([_req("a")], 100)[0]) for _ in range(EXPLORE)]
    assert set(sizes[:-1]) == {7} and sizes[-1] == 8
    dear = Speculation(EchoProposer(seconds=0.05), SpeculationConfig(num_tokens=8))
    for tokens in range(1, 10):
        dear.observe_step(tokens, 0.010)
    sizes = [len(dear.plan([_req("b")], 100)[0]) for _ in range(PROBE_EVERY)]
    assert sizes[-1] == 2 and not any(sizes[:-1])


def test_a_batch_too_big_to_guess_takes_the_decode_lane() -> None:
    """Decodes that alone fill the speculative step budget get no guesses (the batch under
    load): their steps go through the decode lane as without speculation, with the same
    outputs, and guesses come back once the batch has shrunk."""
    prompts = random_prompts(8, seed=5)
    sched, runner = build(overlap=False, proposer=ReferenceProposer(0), max_proposed=4,
                          max_step_tokens=6)
    lane_steps = 0
    build_lane = sched.lane.build

    def counted(running: list[Request], burst: int = 1) -> object:
        nonlocal lane_steps
        step = build_lane(running, burst)
        lane_steps += step is not None
        return step

    sched.lane.build = counted  # type: ignore[method-assign]
    for i, p in enumerate(prompts):  # different lengths: the batch shrinks as they end
        sched.add_request(make_request(str(i), p, 10 + 5 * i))
    out = drain(sched)
    for i, p in enumerate(prompts):
        assert out[str(i)] == reference(p, 10 + 5 * i)
    assert lane_steps > 5
    big = [b for b in runner.batches if len(b.rows) >= 6 and b.num_tokens == len(b.rows)]
    assert big and not any(any(b.proposed) for b in big)
    assert any(any(b.proposed) for b in runner.batches)  # the small batch guessed again
