"""The scheduler: `schedule()` builds a step, `update()` applies what the runner computed for it.

Free of torch: it hands a `Runner` one ForwardBatch and gets a handle whose `result()` is one
StepOutput, so it is tested with a fake runner. `step()` is one turn of the engine loop:

    sequential:  schedule n, launch n, collect n
    overlap:     schedule n, launch n, collect n-1    (n-1's forward ran while n was scheduled)

With overlap, step n is built before step n-1's tokens are known: a decode's input then names
"the token the running step samples for this row" (`ForwardBatch.deferred_inputs`); a request
counts that token as `pending`. A request that ends at step n-1 was already put into step n: its
output there is dropped, and its KV is released only once step n is collected (no running step
ever reads a slot that was handed to someone else).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from banyan.batch import ForwardBatch, StepOutput
from banyan.cache.base import LowerTier, PrefixCache
from banyan.mem.allocator import SlotAllocator
from banyan.scheduler.builder import BatchBuilder, BudgetConfig, ScheduledStep
from banyan.scheduler.decode_lane import DecodeLane
from banyan.scheduler.memory import KVManager
from banyan.scheduler.output import add_prompt_logprobs, decide_end, sampled_update
from banyan.scheduler.policy import PolicyConfig, SchedulePolicy
from banyan.scheduler.queue import WaitingQueue
from banyan.scheduler.request import FinishReason, Request, RequestUpdate, Status
from banyan.scheduler.speculation import Proposer, Speculation, SpeculationConfig

logger = logging.getLogger(__name__)

# A burst of decode steps runs at most this long (measured by the lane's last step), since a
# request arriving meanwhile waits for its end: at batch 1 on a 2-core CPU (2.5-6 ms a step)
# 3-8 steps share the host's ~0.3 ms a step (docs/performance.md), a 64-decode step (~30 ms)
# runs alone.
BURST_BUDGET_S = 0.02


class StepHandle(Protocol):
    def result(self) -> StepOutput:
        """Block until the step is computed; raise what the step raised."""
        ...


class Runner(Protocol):
    def launch(self, batch: ForwardBatch) -> StepHandle:
        """Start computing a step and return at once (steps run in launch order)."""
        ...

    def close(self) -> None:
        """Release what the runner holds (a worker thread)."""
        ...


@dataclass(slots=True)
class SchedulerConfig:
    max_model_len: int
    budget: BudgetConfig
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    overlap: bool = False  # schedule step n while step n-1 runs
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)  # with a proposer
    check_integrity: bool = False  # assert the KV bookkeeping after every step (tests)
    # Most decode steps one lane step runs back to back (ForwardBatch.decode_steps); 1: none
    decode_steps: int = 1


@dataclass(slots=True)
class StepStats:
    """Host time of the last loop turn by phase, and what the step launched in it computes."""

    schedule: float = 0.0
    launch: float = 0.0  # the runner's host-side preparation (launch returns at once)
    wait: float = 0.0  # blocked on the collected step's result
    output: float = 0.0  # tokens applied, text streamed, requests released
    timings: dict[str, float] = field(default_factory=dict)  # the collected step's own split
    num_tokens: int = 0
    num_reqs: int = 0
    num_retracted: int = 0

    @property
    def run(self) -> float:
        return self.launch + self.wait


class Scheduler:
    # The usual decode token applied inline in _update_decodes (False: every token through
    # sampled_update; tests compare the two).
    inline_decode_updates = True
    # Steady decode steps through the decode lane (False: the general path; tests compare).
    use_decode_lane = True

    def __init__(self, runner: Runner, config: SchedulerConfig, allocator: SlotAllocator,
                 cache: PrefixCache, proposer: Proposer | None = None,
                 tier: LowerTier | None = None) -> None:
        self.runner = runner
        self.config = config
        self.kv = KVManager(allocator, cache, config.budget.max_running_requests, tier)
        self.speculation = (Speculation(proposer, config.speculation)
                            if proposer is not None else None)
        self.builder = BatchBuilder(config.budget, self.kv, SchedulePolicy(config.policy, cache),
                                    self.speculation)
        self.lane = DecodeLane(self.kv, self.builder, config.max_model_len)
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.last_step = StepStats()
        self.total_retractions = 0
        self._seq = itertools.count()
        self._nothing_to_do: list[Request] = []
        self._in_flight: tuple[ScheduledStep, StepHandle] | None = None  # overlap only
        self._ended_in_flight: set[Request] = set()  # ended, KV held until their step is collected
        self._lane_step_s = 0.0  # the last lane step's forward, per decode step (0: none yet)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._nothing_to_do or self._in_flight)

    def add_request(self, req: Request) -> None:
        """Queue a request; ValueError when it could never run here."""
        if req.rid in self.requests:
            raise ValueError(f"request id {req.rid!r} is already in use")
        if not req.prompt_ids:
            raise ValueError("prompt is empty: at least one token is needed")
        if len(req.prompt_ids) >= self.config.max_model_len:
            raise ValueError(
                f"prompt of {len(req.prompt_ids)} tokens does not fit the context length "
                f"({self.config.max_model_len} tokens, including at least one generated token)"
            )
        capacity = self.kv.capacity
        if len(req.prompt_ids) + req.max_new_tokens > capacity:
            raise ValueError(
                f"prompt of {len(req.prompt_ids)} tokens plus max_new_tokens="
                f"{req.max_new_tokens} can never fit in the KV cache ({capacity} tokens); "
                f"raise --kv-cache-memory or lower max_new_tokens"
            )
        # The context length bounds generation: knowing it up front lets a step be scheduled
        # before the previous one's tokens arrive (overlap) without running past it.
        req.max_new_tokens = min(req.max_new_tokens,
                                 self.config.max_model_len - len(req.prompt_ids))
        req.arrival_seq = next(self._seq)
        self.requests[req.rid] = req
        if req.max_new_tokens == 0 and not req.wants_prompt_logprobs:
            self._nothing_to_do.append(req)  # done without computing, at the next step
        else:
            self.waiting.push(req)

    def abort(self, rid: str) -> RequestUpdate | None:
        """End a request now, wherever it is; its KV returns to the pool at once (or when the
        step still reading it is collected)."""
        req = self.requests.get(rid)
        if req is None:
            return None
        if req in self._nothing_to_do:
            self._nothing_to_do.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        elif req.status is Status.RUNNING:
            self.running.remove(req)
        req.finish_reason = FinishReason.ABORT
        self._finish(req)
        self._collect_if_idle()
        text = req.text.finish() if req.text is not None else ""
        return RequestUpdate(rid, [], text, FinishReason.ABORT, prompt_tokens=len(req.prompt_ids),
                             cached_tokens=req.cached_tokens)

    # ---- the loop ------------------------------------------------------------------------

    def step(self) -> list[RequestUpdate]:
        """One turn of the engine loop; what happened to each request it touched."""
        stats = StepStats()
        updates = self._finish_zero_length()
        t0 = time.perf_counter()
        step = self.schedule()
        t1 = time.perf_counter()
        handle = None if step.empty else self.runner.launch(step.batch)
        t2 = time.perf_counter()
        stats.schedule, stats.launch = t1 - t0, t2 - t1
        stats.num_retracted = len(step.retracted)
        stats.num_tokens, stats.num_reqs = step.batch.num_tokens, step.batch.batch_size
        launched = None if handle is None else (step, handle)
        if self.config.overlap:
            collect, self._in_flight = self._in_flight, launched
        else:
            collect = launched
        if collect is not None:
            updates += self._collect(*collect, stats)
        self._collect_if_idle()
        self.last_step = stats
        return updates

    def _collect_if_idle(self) -> None:
        """When every request in the running step has ended, collect it now (what it computed
        is void) to release their KV rather than hold it until the next request arrives."""
        if self._in_flight is not None and not (self.running or self.waiting):
            step, handle = self._in_flight
            self._in_flight = None
            assert not self._collect(step, handle, StepStats()), "only ended requests were left"

    def schedule(self) -> ScheduledStep:
        """Build the next step: admit, chunk, retract; allocates its KV slots."""
        step = None
        guessing = self.speculation is not None and \
            not self.speculation.guesses_nothing(len(self.running))
        if self.use_decode_lane and not (self.config.overlap or guessing or self._nothing_to_do) \
                and (not self.waiting or self.builder.admission_closed(self.running)):
            step = self.lane.build(self.running, self._burst())
        if step is None:
            self.lane.clear()  # the general path changes what the lane keeps
            step = self.builder.build(self.running, self.waiting)
        self.total_retractions += len(step.retracted)
        if step.retracted:
            logger.info("retracted %d request(s): KV cache full", len(step.retracted))
        return step

    def _burst(self) -> int:
        """Decode steps the next lane step may run back to back (BURST_BUDGET_S)."""
        if self.config.decode_steps <= 1 or self._lane_step_s <= 0.0:
            return 1
        return max(1, min(self.config.decode_steps, int(BURST_BUDGET_S / self._lane_step_s)))

    def _collect(self, step: ScheduledStep, handle: StepHandle,
                 stats: StepStats) -> list[RequestUpdate]:
        t0 = time.perf_counter()
        try:
            out = handle.result()
        except Exception as exc:  # one bad step must not kill the engine or other requests
            logger.exception("step failed; aborting its %d request(s)", len(step.reqs))
            if step.lane:
                self.lane.settle(step)
            return self._fail(step, exc)
        t1 = time.perf_counter()
        if self.kv.tier is not None:  # prompt compute speed, for the tier's load-or-recompute
            prompt_tokens = step.batch.num_tokens - step.batch.batch_size
            if prompt_tokens >= 32 and "forward" in out.timings:
                self.kv.tier.observe_compute(step.batch.num_tokens, out.timings["forward"])
        if self.speculation is not None and "forward" in out.timings:
            batch = step.batch
            if batch.num_tokens == batch.batch_size + sum(map(len, batch.proposed)):
                # decodes (and guesses) only: the step sizes speculation prices
                self.speculation.observe_step(batch.num_tokens, out.timings["forward"])
        if step.lane and "forward" in out.timings and out.sampled_token_ids:
            self._lane_step_s = out.timings["forward"] / max(1, len(out.sampled_token_ids[0]))
        updates = self.update(step, out)
        stats.wait, stats.output = t1 - t0, time.perf_counter() - t1
        stats.timings = out.timings
        return updates

    def update(self, step: ScheduledStep, out: StepOutput) -> list[RequestUpdate]:
        """Apply a collected step: tokens to requests, finished requests released, prefill
        chunks offered to the prefix cache, unused speculative slots handed back."""
        batch = step.batch
        if len(out.sampled_token_ids) != len(step.sampled):
            raise RuntimeError(f"runner answered {len(out.sampled_token_ids)} rows for "
                               f"{len(step.sampled)} sampling requests")
        if step.lane:
            applied = self.lane.apply(step, out)
            if applied is not None:
                updates, ended = applied
                for req in ended:
                    self._end(req, Status.RUNNING)
                if self.config.check_integrity:
                    self.kv.check_integrity(self.running, self._ended_in_flight)
                return updates
            self.lane.settle(step)  # the general rules apply to this step
        if len(step.sampled) == len(step.reqs) == batch.num_tokens and not batch.prompt_logprobs:
            return self._update_decodes(step, out)
        updates: list[RequestUpdate] = []
        speculative: set[int] = set()
        outputs, logprobs = out.sampled_token_ids, out.logprobs
        max_len = self.config.max_model_len
        running, finished = Status.RUNNING, Status.FINISHED
        for span, entries in zip(batch.prompt_logprobs, out.prompt_logprobs, strict=True):
            add_prompt_logprobs(step.reqs[span.index], span.position, entries)
        for j, req in enumerate(step.sampled):
            req.pending -= 1
            if req.status is finished:
                continue  # ended while this step ran: what it computed for it is void
            update = sampled_update(req, outputs[j], logprobs[j] if logprobs else [], max_len)
            updates.append(update)
            proposed = batch.proposed[j] if batch.proposed else None
            if proposed:
                assert self.speculation is not None
                self.speculation.record(req, len(proposed), len(outputs[j]) - 1)
                speculative.add(batch.sample_indices[j])
                if req.status is running:  # KV is valid for the input and accepted tokens
                    self.kv.drop_tail(req, len(proposed) + 1 - len(update.new_token_ids))
        for i, (req, prefix, n) in enumerate(zip(step.reqs, batch.prefix_lens,
                                                 batch.extend_lens, strict=True)):
            req.inflight -= 1
            status = req.status
            if status is running:
                written = min(prefix + n, len(req.slots))
                if written > req.written:
                    req.written = written
            if status is finished:
                self._release_if_collected(req)
            elif req.finish_reason is not None:  # ended by this step's tokens
                self._end(req, status)
            elif n > 1 and status is running and i not in speculative:
                # a prefill chunk: share it with waiting requests now, not at the end
                self.kv.cache_unfinished(req, prefix + n)
        if self.config.check_integrity:
            self.kv.check_integrity(self.running, self._ended_in_flight)
        return updates

    def _update_decodes(self, step: ScheduledStep, out: StepOutput) -> list[RequestUpdate]:
        """`update` for a step of decodes only (one token each, nothing proposed, every request
        sampled): its two passes in one, the hot path of a step (once per running request)."""
        updates: list[RequestUpdate] = []
        append = updates.append
        max_len = self.config.max_model_len
        running, finished = Status.RUNNING, Status.FINISHED
        logprobs = out.logprobs or [[]] * len(step.sampled)
        inline = self.inline_decode_updates
        for req, tokens, lps, prefix in zip(step.sampled, out.sampled_token_ids, logprobs,
                                            step.batch.prefix_lens, strict=True):
            req.pending -= 1
            req.inflight -= 1
            status = req.status
            if status is finished:  # ended while this step ran: what it computed is void
                self._release_if_collected(req)
                continue
            if status is running and prefix >= req.written:
                req.written = prefix + 1  # (a running request's slots hold this step's)
            output, stream, token = req.output_ids, req.text, tokens[0]
            if not inline or lps or stream is None or req.grammar is not None or len(tokens) != 1 \
                    or token in req.stop_ids or len(output) + 1 >= req.max_new_tokens \
                    or req.params.prompt_logprobs is not None:
                append(sampled_update(req, tokens, lps, max_len))  # any rule may apply
                if req.finish_reason is not None:
                    self._end(req, status)
                continue
            # The usual decode: one token that neither stops nor reaches a limit (checked
            # above); only a stop string can end it.
            output.append(token)
            text, stopped = stream.push_text(token)
            reason = None
            if stopped:
                text, reason = decide_end(req, text, True, False, max_len)
            append(RequestUpdate(req.rid, tokens, text, reason, prompt_tokens=len(req.prompt_ids),
                                 cached_tokens=req.cached_tokens))
            if stopped:
                self._end(req, status)
        if self.config.check_integrity:
            self.kv.check_integrity(self.running, self._ended_in_flight)
        return updates

    def _fail(self, step: ScheduledStep, exc: Exception) -> list[RequestUpdate]:
        """A step raised: its requests end with an error; the K/V it (and any step after it)
        was to write is never offered to the prefix cache."""
        sampled = set(step.sampled)
        updates = []
        for req, start in zip(step.reqs, step.batch.prefix_lens, strict=True):
            req.inflight -= 1
            req.pending -= req in sampled
            if req.finished:
                self._release_if_collected(req)
                continue
            if req.status is Status.RUNNING:
                self.running.remove(req)
                self.kv.drop_uncomputed(req, start)
            else:
                self.waiting.remove(req)
            req.finish_reason = FinishReason.ABORT
            req.error = f"internal error: {exc}"
            self._finish(req)
            updates.append(RequestUpdate(req.rid, [], "", FinishReason.ABORT,
                                         prompt_tokens=len(req.prompt_ids), error=req.error))
        return updates

    def _finish_zero_length(self) -> list[RequestUpdate]:
        """max_new_tokens=0 asks for nothing to be generated: done without computing."""
        done, self._nothing_to_do = self._nothing_to_do, []
        for req in done:
            req.finish_reason = FinishReason.LENGTH
            self._finish(req)
        return [RequestUpdate(r.rid, [], "", FinishReason.LENGTH,
                              prompt_tokens=len(r.prompt_ids)) for r in done]

    def _end(self, req: Request, status: Status) -> None:
        """A request its step's tokens ended: out of its queue, finished."""
        if status is Status.RUNNING:
            self.running.remove(req)
        else:  # retracted while its last token was sampled
            self.waiting.remove(req)
        self._finish(req)

    def _finish(self, req: Request) -> None:
        req.status = Status.FINISHED
        del self.requests[req.rid]
        if self.speculation is not None:
            self.speculation.forget(req)
        if req.inflight:
            self._ended_in_flight.add(req)
        else:
            self.kv.release(req)

    def _release_if_collected(self, req: Request) -> None:
        if req.inflight == 0 and req in self._ended_in_flight:
            self._ended_in_flight.discard(req)
            self.kv.release(req)
