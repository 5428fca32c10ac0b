"""EngineCore: the tokenizer-aware shell around the Scheduler that turns user requests into
scheduler Requests and steps them. Shared by the offline Engine and the server's engine process,
and the only door to the scheduler: callers ask it for stats, cache flushes and aborts instead
of reaching into the scheduler's queues or prefix cache.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from banyan.args import EngineArgs
from banyan.engine.byte_detok import TokenBytes
from banyan.engine.detok import TextAccumulator
from banyan.sampling.params import SamplingParams
from banyan.scheduler import Request, RequestUpdate, Scheduler
from banyan.scheduler.request import FinishReason, Status
from banyan.scheduler.scheduler import StepStats
from banyan.scheduler.speculation import SpecStats
from banyan.structured.grammar import GrammarBackend, check_compiles
from banyan.structured.spec import check_json_schema
from banyan.structured.waiting import GrammarWaitlist

if TYPE_CHECKING:
    from banyan.disagg.sink import KVSink
    from banyan.disagg.source import KVSource
    from banyan.mem.prefault import PoolPrefaulter

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class CoreStats:
    """A snapshot of the engine's state and counters."""

    num_running: int
    num_waiting: int
    num_requests: int
    kv_capacity: int
    kv_free: int  # on the free list or in decode runs
    kv_evictable: int  # cached, held by no running request
    kv_protected: int  # cached and locked by running requests
    kv_cached: int  # held by the prefix cache (evictable + protected)
    prefix_queried: int  # prompt tokens looked up in the prefix cache at first admission
    prefix_hit: int  # ... and served from it
    retractions: int
    last_step: StepStats
    spec: SpecStats | None = None  # speculative decoding's counters, when it is on
    tier: dict[str, float] | None = None  # the KV tier's counters (KVTier.counters), when on
    disagg: dict[str, float] | None = None  # the KV transfer's counters (P/D workers)
    # one-token greedy steps whose token the LM head's screen gave / that fell back to the
    # whole head (models/head_screen.py), when the model has a screen
    head_screen: tuple[int, int] | None = None


@dataclass(slots=True)
class SampleGroup:
    """The n samples of one user request: child request ids in sample order."""

    rid: str
    child_rids: list[str]
    prompt_ids: list[int]


class EngineCore:
    def __init__(self, args: EngineArgs, scheduler: Scheduler, tokenizer: Any,
                 eos_ids: frozenset[int], vocab_size: int, max_model_len: int) -> None:
        self.args = args
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        # Byte-level tokenizers stream text from a table of token bytes (engine/byte_detok.py)
        self.token_bytes = TokenBytes.of(tokenizer) if tokenizer is not None else None
        self.eos_ids = eos_ids
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.weight_bytes = 0  # bytes of weights read per forward (for the bandwidth bound)
        self.kv_bytes_per_token = 0  # the KV pool's bytes per slot (codes and scales)
        self.quantization = "none"  # how the linears compute (--quantization, auto resolved)
        self.dtype = "float32"  # what the model computes in (--dtype, auto resolved)
        self._grammars: GrammarWaitlist | None = None  # made at the first structured request
        # Prefill/decode disaggregation (banyan/disagg/): the end this worker's role needs.
        self.kv_sink: KVSink | None = None  # decode: fetches prompts' K/V
        self.kv_source: KVSource | None = None  # prefill: serves its cached K/V
        self.prefaulters: list[PoolPrefaulter] = []  # the KV pools' pages to fault in when idle

    def add(self, rid: str, prompt_ids: Sequence[int], params: SamplingParams,
            namespace: str | None = None, kv_source: str | None = None) -> SampleGroup:
        """Validate and queue a request (n children when params.n > 1). ValueError names the
        problem; nothing is queued then. kv_source: the prefill worker holding the prompt's K/V
        (a decode worker fetches it first, banyan/disagg/sink.py)."""
        params.validate(self.vocab_size)
        if params.allowed_token_ids is not None and params.min_new_tokens > 0:
            stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
            if stops.issuperset(params.allowed_token_ids):
                raise ValueError(f"invalid sampling parameter allowed_token_ids="
                                 f"{params.allowed_token_ids!r}: every one ends the request, "
                                 f"which min_tokens={params.min_new_tokens} forbids")
        if kv_source is not None and self.kv_sink is None:
            raise ValueError("kv_transfer_params: this server is not a decode worker "
                             "(--disaggregation-mode decode)")
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt is empty: at least one token is needed")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt)} tokens is too long: the context length is "
                f"{self.max_model_len} tokens (prompt plus at least one generated token)"
            )
        max_new = min(params.max_new_tokens, self.max_model_len - len(prompt))
        children = []
        for index in range(params.n):
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else params.seed + index
                child_params = params.copy(n=1, seed=seed)
            child_rid = rid if params.n == 1 else f"{rid}#{index}"
            children.append(Request(
                child_rid, prompt, child_params, max_new, eos_ids=self.eos_ids,
                namespace=namespace, text=self._text_stream(prompt, child_params),
            ))
        if params.structured is not None:
            self._check_structured(params)
        if kv_source is not None and self.kv_sink is not None:
            self._queue(self.kv_sink.start(children, kv_source))
            return SampleGroup(rid, [r.rid for r in children], prompt)
        return SampleGroup(rid, self._queue(children), prompt)

    def _queue(self, children: list[Request]) -> list[str]:
        """Into the grammar waitlist (structured output) or the scheduler: all or none."""
        if not children:
            return []
        structured = children[0].params.structured
        if structured is not None:
            self._waitlist().add(structured, children)
            return [r.rid for r in children]
        added: list[str] = []
        try:
            for req in children:
                self.scheduler.add_request(req)
                added.append(req.rid)
        except ValueError:
            for child_rid in added:
                self.scheduler.abort(child_rid)
            raise
        return added

    def _text_stream(self, prompt: list[int], params: SamplingParams) -> Any:
        return TextAccumulator.for_request(self.tokenizer, prompt, params, self.token_bytes)

    @staticmethod
    def _check_structured(params: SamplingParams) -> None:
        """The API server checks first (400); this guards the offline Engine."""
        spec = params.structured
        assert spec is not None
        if spec.kind == "json":
            import json

            check_json_schema(json.loads(spec.value), "structured output")
        check_compiles(spec, "structured output")

    def _waitlist(self) -> GrammarWaitlist:
        if self._grammars is None:
            backend = GrammarBackend(self.tokenizer, self.vocab_size, self.eos_ids)
            self._grammars = GrammarWaitlist(backend, self.args.grammar_compile_timeout)
        return self._grammars

    def step(self) -> list[RequestUpdate]:
        """One turn of the engine loop (overlapped with --overlap on), after moving requests
        whose grammar is compiled into the scheduler."""
        updates: list[RequestUpdate] = []
        if self.kv_sink is not None and self.kv_sink.pending:
            idle = not self.scheduler.has_work and not self._grammars
            for req in self.kv_sink.collect(block_s=0.005 if idle else 0.0):
                try:
                    self._queue([req])
                except ValueError as exc:
                    updates.append(RequestUpdate(req.rid, [], "", FinishReason.ABORT,
                                                 prompt_tokens=len(req.prompt_ids),
                                                 error=str(exc)))
        if self._grammars is not None and len(self._grammars):
            idle = not self.scheduler.has_work
            ready, failed = self._grammars.collect(block_s=0.005 if idle else 0.0)
            for req in ready:
                try:
                    self.scheduler.add_request(req)
                except ValueError as exc:
                    failed.append((req, str(exc)))
            for req, error in failed:
                updates.append(RequestUpdate(req.rid, [], "", FinishReason.ABORT,
                                             prompt_tokens=len(req.prompt_ids), error=error))
        if not self.scheduler.has_work:
            return updates
        return updates + self.scheduler.step()

    def abort(self, rid: str) -> RequestUpdate | None:
        if self.kv_sink is not None and (req := self.kv_sink.remove(rid)) is not None:
            return RequestUpdate(rid, [], "", FinishReason.ABORT,
                                 prompt_tokens=len(req.prompt_ids))
        if self._grammars is not None:
            req = self._grammars.remove(rid)
            if req is not None:
                return RequestUpdate(rid, [], "", FinishReason.ABORT,
                                     prompt_tokens=len(req.prompt_ids))
        return self.scheduler.abort(rid)

    def close(self) -> None:
        """Abort everything and stop the runner's worker (the engine cannot step after)."""
        self.abort_all()
        for end in (self.kv_sink, self.kv_source):
            if end is not None:
                end.close()
        self.scheduler.runner.close()
        if self.scheduler.kv.tier is not None:
            self.scheduler.kv.tier.close()  # blocks still queued are written first
        if self._grammars is not None:
            self._grammars.backend.close()

    @property
    def last_step(self) -> StepStats:
        """Timings of the last loop turn (cheaper than a whole stats() snapshot)."""
        return self.scheduler.last_step

    def abort_all(self) -> list[RequestUpdate]:
        updates = [self.abort(rid) for rid in self._outside_scheduler()]
        updates += [self.abort(rid) for rid in list(self.scheduler.requests)]
        return [u for u in updates if u is not None]

    def _outside_scheduler(self) -> list[str]:
        """Requests waiting for their K/V or their grammar, not yet in the scheduler."""
        waiting = self.kv_sink.rids() if self.kv_sink is not None else []
        return waiting + (self._grammars.rids() if self._grammars is not None else [])

    def request_ids(self) -> list[str]:
        """Ids of the requests not yet finished (n > 1 samples as "rid#i")."""
        return self._outside_scheduler() + list(self.scheduler.requests)

    def is_waiting(self, rid: str) -> bool:
        """Whether the request is queued (or waits for its grammar) and was never admitted
        (or was retracted)."""
        req = self.scheduler.requests.get(rid)
        if req is None:
            return rid in self._outside_scheduler()
        return req.status is Status.WAITING

    def flush_cache(self) -> bool:
        """Drop every cached prefix (e.g. after a weight reload); False while requests run."""
        return self.scheduler.kv.cache.flush()

    def explain_prefix(self, tokens: list[int], namespace: str | None = None) -> dict[str, object]:
        """How much of `tokens` the prefix cache holds now, and why the rest would miss."""
        return self.scheduler.kv.explain(tokens, namespace)

    @property
    def kv_capacity(self) -> int:
        return self.scheduler.kv.capacity

    def stats(self) -> CoreStats:
        sched, kv = self.scheduler, self.scheduler.kv
        return CoreStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            num_requests=len(sched.requests), kv_capacity=kv.capacity, kv_free=kv.free_slots,
            kv_evictable=kv.cache.evictable_size, kv_protected=kv.cache.protected_size,
            kv_cached=kv.cache.cached_size, prefix_queried=kv.prefix_queried,
            prefix_hit=kv.prefix_hit,
            retractions=sched.total_retractions, last_step=sched.last_step,
            spec=sched.speculation.stats if sched.speculation is not None else None,
            tier=kv.tier.counters() if kv.tier is not None else None,
            disagg=self._disagg_counters(),
            head_screen=self._head_screen_counts(),
        )

    def _head_screen_counts(self) -> tuple[int, int] | None:
        stack = getattr(getattr(self.scheduler.runner, "model_runner", None), "stack", None)
        counts = getattr(stack, "screen_counts", None)
        return None if counts is None else (int(counts[0]), int(counts[1]))

    def _disagg_counters(self) -> dict[str, float] | None:
        end = self.kv_sink if self.kv_sink is not None else self.kv_source
        if end is None:
            return None
        return {k: float(v) for k, v in dataclasses.asdict(end.stats).items()}

    def prefault_kv(self) -> bool:
        """Fault in one chunk of the KV pools' pages (mem/prefault.py); call only while idle.
        False once every pool is populated (or cannot be)."""
        for pool in self.prefaulters:
            if not pool.done:
                pool.step()
                return True
        return False

    def populate_kv(self) -> None:
        """All of the KV pools' pages faulted in now, as vLLM's start-up does (benchmarks call
        this before timing; a server does it while idle)."""
        while self.prefault_kv():
            pass

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._grammars is not None and len(self._grammars)) \
            or bool(self.kv_sink is not None and self.kv_sink.pending)
