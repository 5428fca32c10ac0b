"""Speculative decoding on the scheduler's side: who gets proposals, how many, and what came of
them.

A `Proposer` guesses each decoding request's next tokens (n-gram lookup over its own text, or a
small draft model); the runner checks all of them in the step that decodes the request and
answers with the accepted ones plus the model's own next token. This module decides how many
tokens each request may be given (adaptive) and counts what was proposed and accepted.

Adaptive, because a guess is free only while the forward is memory-bound: at batch 1 on a CPU,
checking 4-8 tokens often costs about what one costs, but a batch of 64 decodes is already
compute-bound and every rejected guess is paid in full. So:
- per step: proposals only fill the step up to `max_step_tokens` tokens of decode work (decodes
  plus guesses); a batch with more decodes than that gets none (the measured knee, see
  docs/performance.md "Speculative decoding");
- per step: the engine's own decode steps are timed by size (`StepCost`), and the step takes
  the number of guesses, likeliest first, that gives it the most expected tokens per second,
  the proposer's own measured time counted in (a draft model's forward per guessed position).
  Where the kernels are compute-bound even at one token (4-bit weights on an AVX2 CPU: a
  5-token check cost ~4x a decode) this turns guessing down or off; where checking is nearly
  free it changes nothing; where the draft costs more than a batch's decodes gain from it
  (4 chat requests at once on Zen 4: 0.5x with every guess a draft makes), it turns it off;
- per request: an exponential average of the fraction of its guesses accepted sets how many it
  gets (`k * rate`, at least 1); below `min_rate` it gets none for `cooldown` steps, then one
  probe, so a request whose text stopped repeating stops paying for guesses.
Torch-free like the rest of the scheduler; proposers that run a model are injected.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from banyan.scheduler.request import Request


class Proposer(Protocol):
    """Guesses the next tokens of decoding requests (batched: a draft model runs them at once)."""

    def propose(self, reqs: Sequence[Request], max_tokens: Sequence[int]) -> list[list[int]]:
        """Per request, at most max_tokens[i] tokens that may follow req's tokens so far."""
        ...

    def forget(self, req: Request) -> None:
        """req has ended: drop what is kept for it (a draft model's KV)."""
        ...

    def seconds_per_position(self, requests: int) -> float:
        """The measured cost of guessing one more token for each of `requests` requests (a draft
        model's forward); 0.0 for a proposer whose guesses are nearly free (a lookup)."""
        ...


@dataclass(slots=True)
class SpeculationConfig:
    # most tokens proposed per request per step: 12, since checking them costs ~1.05-1.3x a
    # decode at batch 1 in bf16 (spec_step_cost.py; a 9-token check 14 ms beside an 11 ms decode
    # on Zen 4) and a grounded answer copies long runs (spec_side_by_side.py, Zen 4: grounded
    # ngram 2.61x with 12 against 1.95x with 8, acceptance length 7.1 against 4.5; chat and the
    # draft model the same with either); a request's own acceptance rate scales it down
    num_tokens: int = 12
    max_step_tokens: int = 16  # decode work of a step (decodes + guesses) speculation may fill
    min_rate: float = 0.15  # acceptance rate below which a request pauses speculation
    cooldown: int = 8  # steps a paused request goes without guesses before the next probe
    ema: float = 0.5  # weight of the latest step in the acceptance average

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError(f"speculative_num_tokens must be >= 1, got {self.num_tokens}")
        if self.max_step_tokens < 2:
            raise ValueError("speculative_max_step_tokens must be >= 2, "
                             f"got {self.max_step_tokens}")


@dataclass(slots=True)
class SpecStats:
    """Counters with vLLM's meaning: a draft is one request's guess in one step."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [num_tokens]

    @property
    def num_emitted_tokens(self) -> int:
        """Tokens the verifying steps produced: the accepted guesses plus one per draft."""
        return self.num_accepted_tokens + self.num_drafts

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verifying step of a request (1 = no guess ever accepted)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def per_position_rate(self) -> list[float]:
        """Of the drafts, the fraction whose i-th guess was accepted."""
        return [a / self.num_drafts if self.num_drafts else 0.0 for a in self.accepted_per_pos]

    def since(self, earlier: SpecStats) -> SpecStats:
        """The counts between an earlier snapshot and now (one benchmark run)."""
        return SpecStats(self.num_drafts - earlier.num_drafts,
                         self.num_draft_tokens - earlier.num_draft_tokens,
                         self.num_accepted_tokens - earlier.num_accepted_tokens,
                         [a - b for a, b in zip(self.accepted_per_pos, earlier.accepted_per_pos,
                                                strict=True)])

    def copy(self) -> SpecStats:
        return self.since(SpecStats(accepted_per_pos=[0] * len(self.accepted_per_pos)))

    def as_dict(self) -> dict[str, object]:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_emitted_tokens": self.num_emitted_tokens,
                "mean_acceptance_length": round(self.mean_acceptance_length, 4),
                "acceptance_rate": round(self.acceptance_rate, 4),
                "accepted_per_pos": list(self.accepted_per_pos),
                "per_position_rate": [round(r, 4) for r in self.per_position_rate()]}


@dataclass(slots=True)
class StepCost:
    """Forward seconds of a decode-only step by its size in tokens (decodes plus guesses): the
    median of the last WINDOW steps of each size the engine ran, i.e. what checking g guesses
    costs on this machine and model, measured rather than assumed. The cost is no line: on a
    CPU a 1-token step may take a fused native path that a 5-token check cannot (Zen 3: 25 ms
    then 35 ms, and ~1 ms per guess after that). A median, not an average: one step stalled
    by a neighbour or a collector pause (several times its cost) moved an average enough to
    price guessing out, and a price nobody acts on is never measured again (an int4 draft on
    Zen 4 guessed nothing at all in the last of five rounds of chat)."""

    WINDOW = 5
    seconds: dict[int, float] = field(default_factory=dict)
    recent: dict[int, deque[float]] = field(default_factory=dict)

    def observe(self, tokens: int, seconds: float) -> None:
        times = self.recent.setdefault(tokens, deque(maxlen=self.WINDOW))
        times.append(seconds)
        self.seconds[tokens] = statistics.median(times)

    def at(self, tokens: int) -> float | None:
        """A step of `tokens`, priced as the largest size seen that is not larger (a size not
        seen yet is priced optimistically, so that it gets tried), and never above a larger
        size seen: a bigger step does more work, so a dearer price for a smaller one is the
        machine's noise, which would otherwise price that size out until it is timed again
        (chat on Zen 4, a GGUF draft: checks timed once in a slow second held requests to 5-6
        guesses, of which 96-98% were accepted). None: nothing seen."""
        known = [t for t in self.seconds if t <= tokens]
        if not known:
            return None
        larger = [s for t, s in self.seconds.items() if t >= tokens]
        return min([self.seconds[max(known)], *larger])


MARGIN = 1.1  # guesses must raise tokens per second by this much: proposing costs too
EXPLORE = 32  # every this many steps the guesses are not cut (sizes measured again), or with a
# costly proposer, a step that guesses takes one guess more than priced (the next size timed)
RECOVER = 0.05  # a costly proposer's request priced out: its rate's rise per step
# alone and priced out, a costly proposer's request guesses 2 every this many steps, so that the
# prices are measured again (a draft forward is timed from the second guess on): ~1% of a
# step's time where guessing really does not pay
PROBE_EVERY = 4 * EXPLORE


@dataclass(slots=True)
class _RequestState:
    rate: float = 1.0  # optimistic until guesses say otherwise
    paused_for: int = 0


class Speculation:
    def __init__(self, proposer: Proposer, config: SpeculationConfig) -> None:
        self.proposer = proposer
        self.config = config
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_tokens)
        self.cost = StepCost()
        self._steps = 0
        self._state: dict[str, _RequestState] = {}

    def plan(self, decoding: Sequence[Request], free_slots: int) -> list[list[int]]:
        """Guesses for each of this step's decodes (empty lists where none), never using more
        than free_slots KV slots (a guess never evicts cache or retracts anyone)."""
        cfg = self.config
        if self.guesses_nothing(len(decoding)) or free_slots <= 0:  # the common case under load
            return [[] for _ in decoding]
        room = min(cfg.max_step_tokens - len(decoding), free_slots)
        wanted: list[int] = []
        for req in decoding:
            k = 0
            # A pending token (overlap) is not known yet: nothing to guess from.
            if room > 0 and not req.pending:
                k = min(self._tokens_for(req), req.max_new_tokens - req.generated - 1, room)
            k = max(k, 0)
            wanted.append(k)
            room -= k
        wanted = self._worth_it(decoding, wanted)
        asked = [i for i, k in enumerate(wanted) if k > 0]
        out: list[list[int]] = [[] for _ in decoding]
        if asked:
            guesses = self.proposer.propose([decoding[i] for i in asked],
                                            [wanted[i] for i in asked])
            for i, guess in zip(asked, guesses, strict=True):
                out[i] = list(guess[: wanted[i]])
        return out

    def guesses_nothing(self, decodes: int) -> bool:
        """Whether a step of this many decodes gets no guess at all: its decodes alone fill
        max_step_tokens (a compute-bound batch). Such steps may go through the decode lane."""
        return decodes >= self.config.max_step_tokens

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A decode-only step (decodes plus guesses) took `seconds` of forward."""
        self.cost.observe(tokens, seconds)

    def _worth_it(self, decoding: Sequence[Request], wanted: list[int]) -> list[int]:
        """`wanted` cut to the number of guesses that gives the step the most expected tokens
        per second, by the measured cost of each step size and of proposing: each guess of a
        request counts its rate (the fraction of its guesses accepted, measured at the length
        it is given), the likeliest requests' guesses go first. Sizes priced once and never
        chosen again get measured again: with a nearly free proposer every EXPLORE-th step
        keeps `wanted` as it is; with a costly one (a draft model: a full explore cost 13% at
        batch 8) every EXPLORE-th step that guesses takes one guess more than priced, and a
        request alone and priced out guesses 2 every PROBE_EVERY steps."""
        self._steps += 1
        propose = self.proposer.seconds_per_position
        costly = propose(1) > 0.0
        base = self.cost.at(len(decoding))
        if base is None:
            # Nothing priced yet. A costly proposer's guesses wait for one plain step of this
            # size: a batch that always guesses never times one (each step is bigger).
            return [0] * len(wanted) if costly else wanted
        explore = self._steps % EXPLORE == 0
        if explore and not costly:
            return wanted
        rates = [self._state[r.rid].rate if r.rid in self._state else 1.0 for r in decoding]
        # by rate, and among equal rates every request's first guess before any second one (a
        # draft model pays per guessed position, whatever the number of requests)
        guesses = sorted(((rates[i], -n, i) for i, k in enumerate(wanted) for n in range(k)),
                         reverse=True)
        d = len(decoding)
        tokens, best, best_rate = float(d), 0, MARGIN * d / base
        counts = [0] * len(wanted)
        positions = guessing = 0
        for g, (p, _, i) in enumerate(guesses, start=1):
            tokens += p
            counts[i] += 1
            positions, guessing = max(positions, counts[i]), guessing + (counts[i] == 1)
            seconds = self.cost.at(d + g)
            seconds = (seconds if seconds is not None else base) + positions * propose(guessing)
            rate = tokens / seconds
            if rate > best_rate:
                best, best_rate = g, rate
        if explore and 0 < best < len(guesses):
            best += 1
        elif costly and d == 1 and best == 0 and self._steps % PROBE_EVERY == 0:
            best = min(2, len(guesses))
        kept = [0] * len(wanted)
        for _, _, i in guesses[:best]:
            kept[i] += 1
        # A request's rate is measured only by guessing: one whose guesses are all cut pauses
        # as a failing one does and then probes with one guess, which is never cut. Not so
        # where guessing itself costs (a draft model): its first guess after a pause runs a
        # draft forward over every token since the last (the catch-up), which no price here
        # counts. There a request priced out keeps its rate; alone, the rate creeps back up a
        # little each step it is cut (one bad check halves it), so that guessing resumes after
        # a few tokens; in a batch it pauses, and its probe is priced like any guess.
        cfg = self.config
        for i, req in enumerate(decoding):
            state = self._state.setdefault(req.rid, _RequestState())
            if state.rate <= cfg.min_rate and not costly:  # the probe after a pause
                kept[i] = wanted[i]
            elif wanted[i] and not kept[i]:
                if not costly:
                    state.paused_for, state.rate = cfg.cooldown, cfg.min_rate
                elif d == 1:
                    state.rate = min(1.0, state.rate + RECOVER)
                else:
                    state.paused_for = cfg.cooldown
        return kept

    def _tokens_for(self, req: Request) -> int:
        state = self._state.get(req.rid)
        if state is None:
            return self.config.num_tokens
        if state.paused_for > 0:
            state.paused_for -= 1
            return 1 if state.paused_for == 0 else 0  # the probe after a pause
        return max(1, min(self.config.num_tokens, math.ceil(self.config.num_tokens * state.rate)))

    def record(self, req: Request, proposed: int, accepted: int) -> None:
        """A verified draft: `accepted` of req's `proposed` guesses were the model's tokens."""
        if proposed <= 0:
            return
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += proposed
        stats.num_accepted_tokens += accepted
        for pos in range(min(accepted, len(stats.accepted_per_pos))):
            stats.accepted_per_pos[pos] += 1
        state = self._state.setdefault(req.rid, _RequestState())
        cfg = self.config
        state.rate = (1 - cfg.ema) * state.rate + cfg.ema * accepted / proposed
        if state.rate < cfg.min_rate:
            state.paused_for = cfg.cooldown
            state.rate = cfg.min_rate  # the probe starts from the threshold, not from zero

    def forget(self, req: Request) -> None:
        self._state.pop(req.rid, None)
        self.proposer.forget(req)
