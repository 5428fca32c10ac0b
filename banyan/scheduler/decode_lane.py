"""The decode lane: steady decoding scheduled and applied with the least work per request.

Most steps of a busy engine are the same: the same running requests, each decoding one plain
token, nobody waiting. The general path (builder.py, Scheduler.update) classifies every request,
looks up its sampling row, counts pending and in-flight tokens, checks stop tokens and limits one
by one: ~20 Python operations per request per step, which at 256 running requests is most of the
host's time (an operation costs 30-60 ns there, the forward between two steps having evicted the
requests from the caches). The lane keeps what does not change between such steps (members,
rows, sampling rows, the union of their stop tokens, how many steps until the first could reach
its length limit) and does per request only what a step must: take a KV slot, append the token,
stream its text, make its update.

It runs only when it gives exactly what the general path would (tests/test_step_pipeline.py
compares both, batch for batch and update for update): no overlap (a request's pending and
in-flight counts stay 0 between sequential steps, so the lane need not count them), no guesses
(no speculation, or a batch too big for any: Speculation.guesses_nothing), nothing waiting,
every member decoding with sampling that reads no history (its SamplingRow is reused), no
logprobs, no grammar. A sampled stop token, a short pool, a failed step or a change of members
hands the step back to the general path (`settle`); stop strings (the text stream reports them)
and length limits (checked only in the steps where one may be reached) end members inline.

Bursts (ForwardBatch.decode_steps): where every member is plain greedy, the lane may ask for
several decode steps at once, a KV slot a step a member, never past a member's length limit.
Their tokens go through the general rules per member (apply_tokens: stop tokens, stop strings,
limits), and the slots of inputs behind a member's last kept token go back to the pool.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import repeat

from banyan.batch import SamplingRow, StepOutput
from banyan.scheduler.builder import BatchBuilder, ScheduledStep
from banyan.scheduler.memory import KVManager
from banyan.scheduler.output import apply_tokens, decide_end
from banyan.scheduler.request import Request, RequestUpdate, Status


def _no_text(token: int) -> tuple[str, bool]:
    return "", False


class DecodeLane:
    def __init__(self, kv: KVManager, builder: BatchBuilder, max_model_len: int) -> None:
        self.kv = kv
        self.builder = builder
        self.max_model_len = max_model_len
        self.members: list[Request] = []  # batch order (== the running list); empty: none
        self._rows: list[int] = []
        self._sampling: list[SamplingRow] = []
        self._push: list[Callable[[int], tuple[str, bool]]] = []  # each member's text stream
        # All members' streams of one kind that pushes many at once (request.py's TextStream)
        self._push_many: Callable[[Sequence[object], Sequence[int]], list[str]] | None = None
        self._streams: list[object] = []
        self._meta: list[tuple[str, int, int]] = []  # rid, prompt tokens, cached tokens
        self._inputs: list[int] = []  # the next step's input tokens (the last ones sampled)
        self._stops: frozenset[int] = frozenset()  # any member's stop tokens
        # Lane steps before a member could reach its length limit (until then the limits go
        # unchecked)
        self._horizon = 0
        # Shared KV slots are a cached prefix that two members locked: no two share more than
        # this (ForwardBatch.max_shared_prefix; None: not known)
        self._max_shared: int | None = 0
        # Members refused for good (their parameters), so a step does not retry forming
        # (ids, not the requests: a request that ends must not be kept alive by this)
        self._refused: list[int] = []
        self._greedy = False  # every member plain greedy: bursts may run

    def clear(self) -> None:
        """Forget the members (and every reference to them and their streams)."""
        self.members, self._rows, self._sampling, self._push, self._meta = [], [], [], [], []
        self._inputs, self._streams, self._push_many = [], [], None

    def build(self, running: list[Request], burst: int = 1) -> ScheduledStep | None:
        """The step of every running request decoding (`burst` decode steps of them back to
        back where every member is plain greedy and slots and length limits allow:
        ForwardBatch.decode_steps), or None when the lane cannot take it (the general path
        builds it then)."""
        if running != self.members and not self._form(running):
            return None
        n = len(running)
        free = self.kv.allocator.num_free
        if free < n:
            self.clear()  # a short pool: the general path's rules (eviction, retraction)
            return None
        # (a burst never runs past a member's length limit: tokens no one would keep)
        steps = min(burst, self._horizon, free // n) if self._greedy else 1
        step = ScheduledStep(lane=True)
        batch = step.batch
        prefix: list[int] = []
        out_slots: list[int] = []
        later: list[list[int]] = []  # per member, its slots for sub-steps 1..
        take = self._take_slot
        for req in running:
            slots, run = req.slots, req.decode_run
            start = len(slots)
            slot = run.pop() if len(run) > 1 else take(req)
            slots.append(slot)
            prefix.append(start)
            out_slots.append(slot)
            if steps > 1:  # (the usual step takes one slot: no list a member)
                more = [take(req) for _ in range(steps - 1)]
                slots += more
                later.append(more)
            req.row_synced = start + steps
        if steps > 1:
            batch.decode_steps, batch.burst_stops = steps, self._stops
            batch.later_slots = [slot for sub_step in zip(*later) for slot in sub_step]
        # (copies: a batch's lists belong to it, whatever keeps it)
        batch.rows = list(self._rows)
        batch.prefix_lens = prefix
        batch.extend_lens = [1] * n
        batch.input_ids = self._inputs
        batch.out_slots = out_slots
        batch.sample_indices = list(range(n))
        batch.sampling = list(self._sampling)
        batch.max_shared_prefix = self._max_shared
        step.reqs = list(running)
        step.sampled = list(running)
        self.builder.adapt_ratio(step)
        return step

    def _take_slot(self, req: Request) -> int:
        """A KV slot for req's next input: from its decode run, else as KVManager.alloc_for
        gives one (the caller checked that free slots cover the step)."""
        run = req.decode_run
        if len(run) > 1:
            return run.pop()
        taken = self.kv.alloc_for(req, 1)
        assert taken is not None, "checked: free slots cover every member"
        return taken[0]

    def apply(self, step: ScheduledStep, out: StepOutput
              ) -> tuple[list[RequestUpdate], list[Request]] | None:
        """The lane step's tokens applied: (updates, members that ended: a stop string or a
        length limit), or None when the step needs the general path (a stop token sampled);
        `settle` it then."""
        if step.batch.decode_steps > 1:
            return self._apply_burst(step, out)
        outputs = out.sampled_token_ids
        flat = [t[0] for t in outputs]
        # (members asked for no logprobs: a runner may still answer empty lists for them)
        if not self._stops.isdisjoint(flat) or sum(map(len, outputs)) != len(outputs) \
                or any(out.logprobs):
            self.clear()
            return None
        updates: list[RequestUpdate] = []
        append = updates.append
        ended: list[Request] = []
        at_limits = self._horizon < 2  # some member may reach its length limit now
        max_len = self.max_model_len
        pushed: Iterable[tuple[str, bool]]
        if self._push_many is not None:  # (streams that never stop)
            pushed = zip(self._push_many(self._streams, flat), repeat(False))
        else:
            pushed = [push(token) for push, token in zip(self._push, flat)]
        for req, tokens, token, start, (text, stopped), (rid, prompt_tokens, cached) in zip(
                step.reqs, outputs, flat, step.batch.prefix_lens, pushed, self._meta):
            req.written = start + 1
            req.output_ids.append(token)
            reason = None
            if stopped or at_limits:
                text, reason = decide_end(req, text, stopped, False, max_len)
                if reason is not None:
                    ended.append(req)
            append(RequestUpdate(rid, tokens, text, reason, [], prompt_tokens, cached))
        self._inputs = flat
        self._horizon -= 1
        if ended:
            self.clear()
        return updates, ended

    def _apply_burst(self, step: ScheduledStep, out: StepOutput
                     ) -> tuple[list[RequestUpdate], list[Request]]:
        """apply for a burst: each member's tokens (the same count for all) through the general
        rules (stop tokens and strings, limits: the tokens after one that ends a member are
        dropped), the slots of inputs no kept token needs handed back."""
        outputs = out.sampled_token_ids
        steps = step.batch.decode_steps
        done = len(outputs[0])
        if not 1 <= done <= steps or any(len(t) != done for t in outputs):
            raise RuntimeError(f"runner answered {[len(t) for t in outputs]} tokens for a "
                               f"burst of {steps} decode steps")
        updates: list[RequestUpdate] = []
        ended: list[Request] = []
        for req, tokens, start in zip(step.reqs, outputs, step.batch.prefix_lens, strict=True):
            update = apply_tokens(req, tokens, [], self.max_model_len)
            kept = len(update.new_token_ids)
            # K/V is written for the inputs of the sub-steps run; a kept token's input is one
            self.kv.drop_tail(req, steps - kept)
            req.written = start + kept
            updates.append(update)
            if update.finish_reason is not None:
                ended.append(req)
        self._inputs = [tokens[-1] for tokens in outputs]
        self._horizon -= done
        if ended:
            self.clear()
        return updates, ended

    def settle(self, step: ScheduledStep) -> None:
        """Make a lane step what the general path would have built (its requests' sampled
        token pending, the step in flight for each), for the general update or failure."""
        for req in step.reqs:
            req.pending += 1
            req.inflight += 1
        self.clear()

    def _form(self, running: list[Request]) -> bool:
        """Take the running requests as members when every one qualifies (see the module)."""
        self.clear()
        ids = list(map(id, running))
        if not running or ids == self._refused:
            return False
        self._refused = []
        rows, sampling, pushes, meta, inputs = [], [], [], [], []
        stops: set[int] = set()
        seen_stops: set[int] = set()  # ids of stop sets already merged (mostly one, shared)
        horizon = self.max_model_len
        max_shared: int | None = 0
        shared_len = self.kv.cache.shared_len
        for req in running:
            srow, row, output, slots = req.sampling_row, req.row, req.output_ids, req.slots
            params = req.params
            if params.logprobs is not None or params.prompt_logprobs is not None \
                    or params.reads_history or req.grammar is not None:
                self._refused = ids  # for as long as these members run
                return False
            if req.pending or req.inflight or srow is None or srow.row != row \
                    or len(req.prompt_ids) + len(output) - len(slots) != 1 \
                    or req.row_synced != len(slots) or req.status is not Status.RUNNING:
                return False  # not (or not yet) in a steady decode: the general path
            assert row is not None
            rows.append(row)
            sampling.append(srow)
            stream = req.text
            pushes.append(_no_text if stream is None else stream.push_text)
            meta.append((req.rid, len(req.prompt_ids), req.cached_tokens))
            inputs.append(output[-1] if output else req.prompt_ids[-1])
            if id(req.stop_ids) not in seen_stops:
                seen_stops.add(id(req.stop_ids))
                stops.update(req.stop_ids)
            if req.locked_len and max_shared is not None:
                shared = shared_len(req.cache_handle)
                max_shared = None if shared is None else max(max_shared, shared)
            horizon = min(horizon, req.max_new_tokens - len(output),
                          self.max_model_len - len(req.prompt_ids) - len(output))
        self.members = list(running)
        self._rows, self._sampling, self._push, self._meta = rows, sampling, pushes, meta
        kinds = {type(req.text) for req in running}
        kind = kinds.pop() if len(kinds) == 1 else None
        self._push_many = getattr(kind, "push_many", None)
        self._streams = [req.text for req in running] if self._push_many is not None else []
        self._inputs, self._stops, self._horizon = inputs, frozenset(stops), horizon
        self._max_shared = max_shared
        self._greedy = all(row.plain for row in sampling)
        return True
