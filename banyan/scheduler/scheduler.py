"""The scheduler loop: admit, build a step, run it, apply the result, release the finished.

Free of torch: it hands a `Runner` one ForwardBatch and gets one StepOutput back, so it is tested
with a fake runner. The offline Engine calls `step()` in-process; the server's engine process
calls it in its own loop.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from banyan.batch import ForwardBatch, StepOutput
from banyan.cache.base import PrefixCache
from banyan.mem.allocator import SlotAllocator
from banyan.scheduler.builder import BatchBuilder, BudgetConfig
from banyan.scheduler.memory import KVManager
from banyan.scheduler.output import apply_step
from banyan.scheduler.policy import PolicyConfig, SchedulePolicy
from banyan.scheduler.queue import WaitingQueue
from banyan.scheduler.request import FinishReason, Request, RequestUpdate, Status

logger = logging.getLogger(__name__)


class Runner(Protocol):
    def run(self, batch: ForwardBatch) -> StepOutput: ...


@dataclass(slots=True)
class SchedulerConfig:
    max_model_len: int
    budget: BudgetConfig
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    check_integrity: bool = False  # assert the KV bookkeeping after every step (tests)


@dataclass(slots=True)
class StepStats:
    """Wall time of the last step by phase, and what it computed."""

    schedule: float = 0.0
    run: float = 0.0
    output: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)  # the runner's own split
    num_tokens: int = 0
    num_reqs: int = 0
    num_retracted: int = 0


class Scheduler:
    def __init__(
        self, runner: Runner, config: SchedulerConfig, allocator: SlotAllocator, cache: PrefixCache
    ) -> None:
        self.runner = runner
        self.config = config
        self.kv = KVManager(allocator, cache, config.budget.max_running_requests)
        self.builder = BatchBuilder(config.budget, self.kv, SchedulePolicy(config.policy, cache))
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.last_step = StepStats()
        self.total_retractions = 0
        self._seq = itertools.count()
        self._nothing_to_do: list[Request] = []

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._nothing_to_do)

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
        req.arrival_seq = next(self._seq)
        self.requests[req.rid] = req
        if req.max_new_tokens == 0:
            self._nothing_to_do.append(req)  # done without computing, at the next step
        else:
            self.waiting.push(req)

    def abort(self, rid: str) -> RequestUpdate | None:
        """End a request now, wherever it is; its KV returns to the pool at once."""
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
        text = req.text.finish() if req.text is not None else ""
        return RequestUpdate(rid, [], text, FinishReason.ABORT, prompt_tokens=len(req.prompt_ids),
                             cached_tokens=req.cached_tokens)

    def step(self) -> list[RequestUpdate]:
        """Run one step; return what happened to each request it touched."""
        stats = StepStats()
        t0 = time.perf_counter()
        updates = self._finish_zero_length()
        step = self.builder.build(self.running, self.waiting)
        stats.num_retracted = len(step.retracted)
        self.total_retractions += len(step.retracted)
        if step.retracted:
            logger.info("retracted %d request(s): KV cache full", len(step.retracted))
        t1 = time.perf_counter()
        stats.schedule = t1 - t0
        if step.empty:
            self.last_step = stats
            return updates
        try:
            out = self.runner.run(step.batch)
        except Exception as exc:  # one bad step must not kill the engine or other requests
            logger.exception("step failed; aborting its %d request(s)", len(step.reqs))
            for req, n in zip(step.reqs, step.batch.extend_lens, strict=True):
                self.running.remove(req)
                self.kv.drop_uncomputed(req, n)  # their K/V was never written: not for the cache
                req.finish_reason = FinishReason.ABORT
                req.error = f"internal error: {exc}"
                self._finish(req)
                updates.append(RequestUpdate(req.rid, [], "", FinishReason.ABORT,
                                             prompt_tokens=len(req.prompt_ids), error=req.error))
            return updates
        t2 = time.perf_counter()
        updates += apply_step(step, out, self.config.max_model_len)
        for req, n in zip(step.reqs, step.batch.extend_lens):
            if req.finish_reason is not None:
                self.running.remove(req)
                self._finish(req)
            elif n > 1:  # a prefill (chunk): share it with waiting requests now, not at the end
                self.kv.cache_unfinished(req)
        if self.config.check_integrity:
            self.kv.check_integrity(self.running)
        t3 = time.perf_counter()
        stats.run, stats.output, stats.timings = t2 - t1, t3 - t2, out.timings
        stats.num_tokens, stats.num_reqs = step.batch.num_tokens, step.batch.batch_size
        self.last_step = stats
        return updates

    def _finish_zero_length(self) -> list[RequestUpdate]:
        """max_new_tokens=0 asks for nothing to be generated: done without computing."""
        done, self._nothing_to_do = self._nothing_to_do, []
        for req in done:
            req.finish_reason = FinishReason.LENGTH
            self._finish(req)
        return [RequestUpdate(r.rid, [], "", FinishReason.LENGTH,
                              prompt_tokens=len(r.prompt_ids)) for r in done]

    def _finish(self, req: Request) -> None:
        self.kv.release(req)
        req.status = Status.FINISHED
        del self.requests[req.rid]
