"""Builds one step: who runs, with how many tokens, in which KV slots.

Order of service each step:
1. every running request that is decoding gets its one token (decodes are never starved; when
   slots run out, the most recently admitted requests are retracted to make room);
2. running requests still in chunked prefill continue, under the step's prefill token budget;
3. waiting requests are admitted while the budget, the row count and KV memory allow, keeping
   a reservation for the tokens the running requests are still expected to generate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from banyan.batch import ForwardBatch, PromptLogprobSpan, RowPrefix, SamplingRow
from banyan.scheduler.memory import KVManager
from banyan.scheduler.policy import SchedulePolicy
from banyan.scheduler.queue import WaitingQueue
from banyan.scheduler.request import Request, Status
from banyan.scheduler.speculation import Speculation


@dataclass(slots=True)
class BudgetConfig:
    max_running_requests: int
    max_prefill_tokens: int  # prompt tokens per step, decodes not counted
    chunked_prefill_size: int  # prompt tokens per request per step
    # Admission reserves `ratio * min(tokens still to generate, clip)` slots per running request.
    # The ratio starts high, decays as decodes succeed and jumps back on a retraction (SGLang's
    # scheme): optimistic admission keeps the batch full, retraction catches the misses.
    new_token_ratio_init: float = 0.7
    new_token_ratio_min: float = 0.1
    new_token_ratio_decay: float = 0.002
    reserve_clip: int = 4096


@dataclass(slots=True)
class ScheduledStep:
    batch: ForwardBatch = field(default_factory=ForwardBatch)
    reqs: list[Request] = field(default_factory=list)  # batch order
    sampled: list[Request] = field(default_factory=list)  # order of batch.sample_indices
    retracted: list[Request] = field(default_factory=list)
    lane: bool = False  # built by the decode lane (decode_lane.py), applied by it

    @property
    def empty(self) -> bool:
        return not self.reqs


class BatchBuilder:
    def __init__(self, config: BudgetConfig, kv: KVManager, policy: SchedulePolicy,
                 speculation: Speculation | None = None) -> None:
        self.config = config
        self.kv = kv
        self.policy = policy
        self.speculation = speculation
        self.new_token_ratio = config.new_token_ratio_init

    def build(self, running: list[Request], waiting: WaitingQueue) -> ScheduledStep:
        step = ScheduledStep()
        chunked = self._schedule_decodes(step, running, waiting)
        budget = self.config.max_prefill_tokens
        for req in chunked:  # prompts still in chunks
            if budget <= 0:
                break
            budget -= self._add_chunk(step, req, budget)
        if waiting:
            # Prompts whose KV no collected step has written in full (chunks in this step, or
            # in one still running with overlap) reach the prefix cache only later, so waiting
            # requests sharing them must not compute the same tokens alongside.
            prefilling = [r for r in running if r.written < len(r.prompt_ids)]
            self._admit(step, running, waiting, budget, prefilling)
        self.adapt_ratio(step)
        return step

    def adapt_ratio(self, step: ScheduledStep) -> None:
        """After each step built: the reservation ratio decays, or jumps back on a retraction."""
        if step.retracted:
            self.new_token_ratio = self.config.new_token_ratio_init
        elif step.reqs:
            self.new_token_ratio = max(
                self.config.new_token_ratio_min,
                self.new_token_ratio - self.config.new_token_ratio_decay,
            )

    def _schedule_decodes(
        self, step: ScheduledStep, running: list[Request], waiting: WaitingQueue
    ) -> list[Request]:
        """Schedule every decoding request (retracting when slots run out); returns the
        running requests still in chunked prefill."""
        decoding: list[Request] = []
        chunked: list[Request] = []
        for r in running:  # once per running request per step: one pass
            # (r.remaining, inlined: a property call per request per step is measurable)
            remaining = len(r.prompt_ids) + len(r.output_ids) + r.pending - len(r.slots)
            if remaining > 1:
                chunked.append(r)
            elif remaining == 1 and not r.ends_with_pending:
                decoding.append(r)
        # (free slots alone cover the decodes in the usual step: `available` sums decode runs)
        while decoding and self.kv.allocator.num_free < len(decoding) \
                and self.kv.available < len(decoding):
            victim = running.pop()  # the most recently admitted
            self.retract(victim, waiting)
            step.retracted.append(victim)
            if victim in decoding:
                decoding.remove(victim)
            if victim in chunked:
                chunked.remove(victim)
        if self.speculation is None or not decoding or \
                self.speculation.guesses_nothing(len(decoding)):  # (a batch under load)
            self._add_decodes(step, decoding)
            if self.speculation is not None:  # (a guess list per sampled row, as _add keeps)
                step.batch.proposed.extend([] for _ in decoding)
            return chunked
        # Guesses only take slots that are free now beyond what the decodes need.
        guesses = self.speculation.plan(decoding, self.kv.allocator.num_free - len(decoding))
        for req, guess in zip(decoding, guesses, strict=True):
            self._add(step, req, 1, guess)
        return chunked

    def _add_chunk(self, step: ScheduledStep, req: Request, budget: int) -> int:
        n = min(req.remaining, self.config.chunked_prefill_size, budget)
        if self.kv.available < n:
            return 0
        self._add(step, req, n)
        return n

    def _admit(
        self,
        step: ScheduledStep,
        running: list[Request],
        waiting: WaitingQueue,
        budget: int,
        prefilling: list[Request],
    ) -> None:
        if step.retracted or self.admission_closed(running):
            # memory is short: admitting now would only retract again; or no room for anyone
            # (then the waiting queue is not even ordered)
            return
        reserved = self._reserved(running)
        for req in self.policy.order(waiting, prefilling):
            # (rows of requests that ended while a step still reads them come back a step later)
            if budget <= 0 or len(running) >= self.config.max_running_requests \
                    or not self.kv.free_rows:
                return
            self.kv.match(req)
            n = min(req.remaining, self.config.chunked_prefill_size, budget)
            own_need = n + min(req.max_new_tokens - len(req.output_ids), self.config.reserve_clip)
            if self.kv.available < n or self.kv.available - n < reserved + math.ceil(
                (own_need - n) * self.new_token_ratio
            ) * bool(running):
                self.kv.unmatch(req)
                return  # first come, first served: nobody overtakes the head of the queue
            if req.num_retractions == 0:
                req.cached_tokens = max(req.locked_len - req.transferred, 0)
                self.kv.count_admission(req)
            waiting.remove(req)
            req.status = Status.RUNNING
            req.row = self.kv.alloc_row()
            running.append(req)
            self._add(step, req, n)
            budget -= n
            reserved += math.ceil((own_need - n) * self.new_token_ratio)

    def admission_closed(self, running: list[Request]) -> bool:
        """No request can be admitted now, whatever it asks: no row or no running place."""
        return len(running) >= self.config.max_running_requests or not self.kv.free_rows

    def _reserved(self, running: list[Request]) -> int:
        clip = self.config.reserve_clip
        future = sum(min(r.max_new_tokens - len(r.output_ids), clip) for r in running)
        return math.ceil(future * self.new_token_ratio)

    def _add(self, step: ScheduledStep, req: Request, n: int, proposed: Sequence[int] = ()) -> None:
        """Put n of req's tokens (then its proposals, if any) into the step. The hot path of a
        step (once per running request), hence the locals."""
        prompt, output, row = req.prompt_ids, req.output_ids, req.row
        assert row is not None
        start = len(req.slots)
        total = len(prompt) + len(output)  # tokens known now
        samples = total + req.pending - start == n  # the sequence's end is in this step
        slots = self.kv.alloc_for(req, n + len(proposed))
        assert slots is not None, "caller checked availability"
        batch = step.batch
        if req.row_synced < start:
            batch.row_prefixes.append(RowPrefix(row, req.slots[:start]))
        input_ids = batch.input_ids
        batch.rows.append(row)
        batch.prefix_lens.append(start)
        batch.extend_lens.append(n + len(proposed))
        if start + n <= total:
            if n == 1:
                input_ids.append(prompt[start] if start < len(prompt)
                                 else output[start - len(prompt)])
            else:
                input_ids.extend(req.token_ids(start, start + n))
        else:  # the last token is the one a running step samples for it (overlap)
            assert start + n - total == 1 and req.pending == 1
            input_ids.extend(req.token_ids(start, total))
            batch.deferred_inputs.append(len(input_ids))
            input_ids.append(0)
        if proposed:
            input_ids.extend(proposed)
        if start < len(prompt) - 1 and req.wants_prompt_logprobs:
            end = min(start + n, len(prompt) - 1)  # positions scoring prompt tokens start+1..end
            batch.prompt_logprobs.append(PromptLogprobSpan(
                len(step.reqs), start, prompt[start + 1 : end + 1],
                req.params.prompt_logprobs or 0))
        batch.out_slots.extend(slots)
        req.slots.extend(slots)
        req.row_synced = start + n + len(proposed)
        req.inflight += 1
        if samples:
            batch.sample_indices.append(len(step.reqs))
            params = req.params
            history = list(output) if params.reads_output_ids else []
            batch.sampling.append(SamplingRow(params, prompt, history, params.seed,
                                              len(output) + req.pending, row, req.pending,
                                              req.grammar))
            if self.speculation is not None:
                batch.proposed.append(list(proposed))
            step.sampled.append(req)
            req.pending += 1
        step.reqs.append(req)

    def _add_decodes(self, step: ScheduledStep, reqs: list[Request]) -> None:
        """`_add(step, req, 1)` for each running decode, unrolled: the hot path of a step (once
        per running request). The same batch either way (tests/test_step_pipeline.py builds
        both and compares)."""
        batch = step.batch
        base = len(step.reqs)
        alloc_for = self.kv.alloc_for
        rows, prefix_lens, input_ids = batch.rows, batch.prefix_lens, batch.input_ids
        out_slots, sampling, deferred = batch.out_slots, batch.sampling, batch.deferred_inputs
        for req in reqs:
            slots, output, row, run = req.slots, req.output_ids, req.row, req.decode_run
            assert row is not None
            start = len(slots)
            if len(run) > 1:
                slot = run.pop()
            else:
                taken = alloc_for(req, 1)
                assert taken is not None, "caller checked availability"
                slot = taken[0]
            if req.row_synced < start:
                batch.row_prefixes.append(RowPrefix(row, slots[:start]))
            rows.append(row)
            prefix_lens.append(start)
            pending = req.pending
            if pending:  # its input is the token a running step samples for it (overlap)
                deferred.append(len(input_ids))
                input_ids.append(0)
            else:  # a decode's input is its sequence's last token (start == tokens - 1)
                input_ids.append(output[-1] if output else req.prompt_ids[-1])
            out_slots.append(slot)
            slots.append(slot)
            req.row_synced = start + 1
            req.inflight += 1
            srow = req.sampling_row
            if srow is None or srow.row != row:
                params = req.params
                srow = SamplingRow(params, req.prompt_ids,
                                   list(output) if params.reads_output_ids else [],
                                   params.seed, len(output) + pending, row, pending,
                                   req.grammar)
                if not params.reads_history:  # the same every step (batch.py): kept
                    req.sampling_row = srow
            sampling.append(srow)
            req.pending = pending + 1
        batch.extend_lens.extend([1] * len(reqs))
        batch.sample_indices.extend(range(base, base + len(reqs)))
        step.sampled.extend(reqs)
        step.reqs.extend(reqs)

    def retract(self, req: Request, waiting: WaitingQueue) -> None:
        """Free (or cache) a running request's KV and requeue it at the front, to be recomputed
        from its prompt and the tokens it has generated so far."""
        self.kv.release(req)
        req.status = Status.WAITING
        req.num_retractions += 1
        waiting.push_front(req)
