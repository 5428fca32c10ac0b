"""The engine process: an EngineCore stepped in a loop, fed and drained over ZMQ.

Each iteration takes every request message already waiting (without blocking while there is
work; blocking on a poll with a timeout when idle), runs one step, and sends all of the step's
request updates in one message together with a stats snapshot. Nothing a client sends can end
the loop: a request the engine refuses is answered with a rejected update, and a failing step
aborts the requests it held.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import zmq

from banyan.args import EngineArgs
from banyan.scheduler import RequestUpdate
from banyan.scheduler.speculation import SpecStats
from banyan.server.ipc import (
    AbortRequest,
    AddRequest,
    ControlReply,
    ControlRequest,
    EngineFailed,
    EngineReady,
    EngineStats,
    PullSocket,
    PushSocket,
    Shutdown,
    StepTimes,
    ToEngine,
    Update,
    UpdateBatch,
)

if TYPE_CHECKING:  # the API server imports this module to name the entry point: no torch there
    from banyan.engine.core import EngineCore

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 200  # how long an idle engine sleeps in poll before checking its parent again
MAX_DRAIN = 4096  # messages taken per iteration, so a flood of adds cannot starve the step
BUSY_WINDOW = 256  # steps over which the device-busy fraction is reported


@dataclass(slots=True)
class _Counters:
    generation_tokens: int = 0
    steps: int = 0
    times: StepTimes = field(default_factory=StepTimes)
    # (wall, busy) of the recent steps, for a busy fraction that tracks the present load
    recent: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=BUSY_WINDOW))


class EngineLoop:
    def __init__(self, core: EngineCore, inbox: PullSocket, outbox: PushSocket,
                 parent_pid: int | None) -> None:
        self.core = core
        self.inbox = inbox
        self.outbox = outbox
        self.parent_pid = parent_pid
        self.stopping = False
        self.counters = _Counters()
        self.groups: dict[str, list[str]] = {}  # user rid -> child rids still in the scheduler
        self.parent_of: dict[str, str] = {}  # child rid -> user rid
        self.arrivals: dict[str, float] = {}  # child rid -> arrival, until first admitted
        # child rid -> seconds it waited before first admitted, until its next update says so
        self.queue_waits: dict[str, float] = {}
        self.finished: list[str] = []  # child rids that ended in the step being sent
        self._last_parent_check = time.monotonic()
        self._poller = zmq.Poller()
        self._poller.register(inbox.socket, zmq.POLLIN)
        if core.kv_source is not None:
            self._poller.register(core.kv_source.socket, zmq.POLLIN)

    # ---- the loop ------------------------------------------------------------------------

    def run(self) -> None:
        while not self.stopping:
            t_iter = time.perf_counter()
            idle = not self.core.has_work
            # idle: fault in a chunk of the KV pool's pages, then look for work without waiting
            handled = self._drain(0 if idle and self.core.prefault_kv() else
                                  IDLE_POLL_MS if idle else 0)
            if self.stopping:
                break
            if not self.core.has_work:
                if handled:  # aborts or adds that ended at once: show the idle state
                    self._send(UpdateBatch([], self.stats()))
                self._check_parent()
                continue
            t_work = time.perf_counter() if idle else t_iter
            updates = self._step()
            waits = self._admitted(t_work)  # before the updates: a first one carries its wait
            self._account(t_work, time.perf_counter())  # before the snapshot: it counts this step
            t_send = time.perf_counter()
            self._send(UpdateBatch([self._update(u) for u in updates], self.stats(), waits))
            sending = time.perf_counter() - t_send  # shows in the next snapshot
            self.counters.times.other += sending
            self.counters.times.wall += sending
            if time.monotonic() - self._last_parent_check > 1.0:
                self._check_parent()

    def _drain(self, timeout_ms: int) -> int:
        source = self.core.kv_source
        if source is not None:  # a prefill worker: decode workers' fetches wake it too
            ready = dict(self._poller.poll(timeout_ms))
            source.serve()
            if self.inbox.socket not in ready:
                return 0
        elif not self.inbox.poll(timeout_ms):
            return 0
        handled = 0
        while handled < MAX_DRAIN:
            try:
                msg = self.inbox.recv_nowait()
            except msgspec.DecodeError:  # cannot happen between our own processes; never fatal
                logger.exception("undecodable message from the API server dropped")
                handled += 1
                continue
            if msg is None:
                break
            handled += 1
            self._handle(msg)
            if self.stopping:
                break
        return handled

    def _handle(self, msg: ToEngine) -> None:
        if isinstance(msg, AddRequest):
            self._add(msg)
        elif isinstance(msg, AbortRequest):
            self._abort(msg.rid)
        elif isinstance(msg, ControlRequest):
            self._send(self._control(msg))
        elif isinstance(msg, Shutdown):
            self.stopping = True

    def _add(self, msg: AddRequest) -> None:
        try:
            group = self.core.add(msg.rid, msg.prompt_ids, msg.params, namespace=msg.namespace,
                                  kv_source=msg.kv_source)
        except Exception as exc:  # noqa: BLE001 - a bad request must never end the loop
            internal = not isinstance(exc, ValueError)
            if internal:
                logger.exception("request %s could not be added", msg.rid)
            reason = f"internal error: {exc}" if internal else str(exc)
            self._send(UpdateBatch([Update(msg.rid, [], "", "abort", error=reason,
                                           refused=500 if internal else 400)], self.stats()))
            return
        self.groups[msg.rid] = list(group.child_rids)
        now = time.perf_counter()
        for child in group.child_rids:
            self.parent_of[child] = msg.rid
            self.arrivals[child] = now

    def _abort(self, rid: str) -> None:
        updates = []
        for child in self.groups.pop(rid, []):
            self.arrivals.pop(child, None)
            self.parent_of.pop(child, None)
            update = self.core.abort(child)
            if update is not None:
                updates.append(self._update(update))
            self.queue_waits.pop(child, None)
        if updates:
            self._send(UpdateBatch(updates, self.stats()))

    def _step(self) -> list[RequestUpdate]:
        try:
            updates = self.core.step()
        except Exception as exc:  # noqa: BLE001 - a scheduler bug must not kill the engine
            logger.exception("engine step failed; aborting every request")
            updates = []
            updates = self.core.abort_all()
            for update in updates:
                update.error = f"internal error: {exc}"
        for update in updates:
            self.counters.generation_tokens += len(update.new_token_ids)
            if update.finish_reason is not None:
                self.finished.append(update.rid)
        return updates

    def _forget(self, child: str) -> None:
        self.arrivals.pop(child, None)
        self.queue_waits.pop(child, None)
        parent = self.parent_of.pop(child, None)
        children = self.groups.get(parent) if parent is not None else None
        if children is not None and child in children:
            children.remove(child)
            if not children:
                del self.groups[parent]

    def _admitted(self, step_start: float) -> list[float]:
        """Queue times of the requests this step admitted for the first time (a request that
        is no longer waiting was admitted at the step's start, when the scheduler ran)."""
        waits = []
        for child, arrival in list(self.arrivals.items()):
            if not self.core.is_waiting(child):
                waits.append(max(step_start - arrival, 0.0))
                self.queue_waits[child] = waits[-1]
                del self.arrivals[child]
        for child in self.finished:  # ended this step: admitted (above) or aborted
            self._forget(child)
        self.finished.clear()
        return waits

    def _account(self, start: float, end: float) -> None:
        last = self.core.last_step
        times = self.counters.times
        wall = end - start
        timings = last.timings
        forward, sample = timings.get("forward", 0.0), timings.get("sample", 0.0)
        if forward + sample > wall:  # overlap: the collected step began in the turn before
            scale = wall / (forward + sample)
            forward, sample = forward * scale, sample * scale
        phases = {"schedule": last.schedule, "prepare": last.launch, "forward": forward,
                  "sample": sample, "output": last.output}
        times.schedule += phases["schedule"]
        times.prepare += phases["prepare"]
        times.forward += phases["forward"]
        times.sample += phases["sample"]
        times.output += phases["output"]
        times.other += max(wall - sum(phases.values()), 0.0)
        times.wall += wall
        self.counters.steps += 1
        self.counters.recent.append((wall, phases["forward"] + phases["sample"]))

    # ---- replies -------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        core = self.core.stats()
        c = self.counters
        recent_wall = sum(w for w, _ in c.recent)
        last = core.last_step
        return EngineStats(
            num_running=core.num_running, num_waiting=core.num_waiting,
            kv_capacity=core.kv_capacity, kv_free=core.kv_free,
            kv_evictable=core.kv_evictable, kv_protected=core.kv_protected,
            prompt_tokens=core.prefix_queried, generation_tokens=c.generation_tokens,
            prefix_cache_queries=core.prefix_queried, prefix_cache_hits=core.prefix_hit,
            retractions=core.retractions, steps=c.steps,
            **_spec_fields(core.spec),
            hicache=core.tier or {},
            disagg=core.disagg or {},
            head_screen=list(core.head_screen or ()),
            times=StepTimes(**{f: getattr(c.times, f) for f in StepTimes.__struct_fields__}),
            busy_fraction=(min(sum(b for _, b in c.recent) / recent_wall, 1.0)
                           if recent_wall else 0.0),
            last_step={"schedule": last.schedule, "launch": last.launch, "wait": last.wait,
                       "output": last.output,
                       **last.timings, "num_tokens": float(last.num_tokens),
                       "num_reqs": float(last.num_reqs)},
        )

    def _control(self, msg: ControlRequest) -> ControlReply:
        if msg.kind == "ping":
            return ControlReply(msg.id, True)
        if msg.kind == "info":
            return ControlReply(msg.id, True, data=self._info())
        if msg.kind == "flush_cache":
            if self.core.has_work:
                return ControlReply(msg.id, False, "cannot flush the cache while requests are "
                                    "running or waiting; retry when the server is idle")
            if not self.core.flush_cache():
                return ControlReply(msg.id, False, "cannot flush: cached prefixes are in use")
            return ControlReply(msg.id, True, "Cache flushed.")
        return ControlReply(msg.id, False, f"unknown control request {msg.kind!r}")

    def _info(self) -> dict[str, object]:
        import dataclasses

        stats = self.stats()
        spec = SpecStats(stats.spec_num_drafts, stats.spec_num_draft_tokens,
                         stats.spec_num_accepted_tokens, stats.spec_accepted_per_pos)
        return {
            "engine_pid": os.getpid(),
            "engine_args": dataclasses.asdict(self.core.args),
            "max_model_len": self.core.max_model_len,
            "vocab_size": self.core.vocab_size,
            "kv_capacity": stats.kv_capacity,
            "dtype": self.core.dtype,
            "kv_cache_dtype": self.core.args.kv_cache_dtype,
            "kv_bytes_per_token": self.core.kv_bytes_per_token,
            "quantization": self.core.quantization,
            "kv_free": stats.kv_free,
            "kv_evictable": stats.kv_evictable,
            "kv_protected": stats.kv_protected,
            "kv_usage": stats.kv_usage,
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "num_requests": len(self.core.request_ids()),
            "prefix_cache_queries": stats.prefix_cache_queries,
            "prefix_cache_hits": stats.prefix_cache_hits,
            "prompt_tokens": stats.prompt_tokens,
            "generation_tokens": stats.generation_tokens,
            "retractions": stats.retractions,
            "steps": stats.steps,
            "busy_fraction": stats.busy_fraction,
            "step_times": {f: getattr(stats.times, f) for f in StepTimes.__struct_fields__},
            "last_step": stats.last_step,
            "speculative": spec.as_dict() if stats.spec_accepted_per_pos else None,
            "hicache": stats.hicache or None,
            "disaggregation": self._disaggregation(stats.disagg),
        }

    def _disaggregation(self, counters: dict[str, float]) -> dict[str, object] | None:
        if not counters:
            return None
        source = self.core.kv_source
        return {"mode": self.core.args.disaggregation_mode,
                "backend": self.core.args.disaggregation_transfer_backend,
                "kv_addr": source.address if source is not None else None, **counters}

    def _update(self, u: RequestUpdate) -> Update:
        return Update(u.rid, u.new_token_ids, u.text,
                      None if u.finish_reason is None else u.finish_reason.value,
                      u.logprobs, u.prompt_tokens, u.cached_tokens, u.error,
                      prompt_logprobs=u.prompt_logprobs,
                      queue_time=self.queue_waits.pop(u.rid, -1.0))

    def _send(self, msg: UpdateBatch | ControlReply) -> None:
        try:
            self.outbox.send(msg)
        except zmq.Again:  # the API server is gone; its death is noticed by _check_parent
            logger.warning("API server is not reading; output dropped")

    def _check_parent(self) -> None:
        """Exit when the API server died without telling us (SIGKILL): no orphans."""
        self._last_parent_check = time.monotonic()
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            logger.warning("API server process %d is gone; engine exiting", self.parent_pid)
            self.stopping = True


def engine_main(args: EngineArgs, inbox_addr: str, outbox_addr: str, parent_pid: int,
                log_level: int = logging.INFO) -> None:
    """Entry point of the engine process (spawned by the launcher)."""
    logging.basicConfig(level=log_level,
                        format="%(asctime)s %(levelname)s engine %(name)s: %(message)s")
    # Ctrl-C reaches the whole process group; the API server decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    outbox = PushSocket(ctx, outbox_addr, bind=False)
    inbox = PullSocket(ctx, inbox_addr, bind=False, kind=ToEngine)
    loop: EngineLoop | None = None

    def on_sigterm(signum: int, frame: object) -> None:
        if loop is not None:
            loop.stopping = True
        else:
            raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    if args.disaggregation_mode == "prefill" and args.disaggregation_prefill_nice:
        # Decode steps first where the roles share cores. Before the build: threads made
        # later (torch's OpenMP pool, the K/V socket's I/O thread) inherit it.
        os.nice(args.disaggregation_prefill_nice)
    import threading

    from tqdm import tqdm

    from banyan.engine.build import build_engine_core

    # tqdm's default lock (the loader's progress bar) is a multiprocessing semaphore, which the
    # os._exit below would leave to the server's resource tracker ("leaked semaphore" at every
    # stop); a process drawing one bar needs a thread lock only.
    tqdm.set_lock(threading.RLock())
    try:
        try:
            core = build_engine_core(args)
        except Exception as exc:  # noqa: BLE001 - report any start-up failure to the launcher
            logger.exception("engine failed to start")
            _send_blocking(outbox, EngineFailed(f"{type(exc).__name__}: {exc}"))
            raise SystemExit(1) from None
        loop = EngineLoop(core, inbox, outbox, parent_pid)
        kv_addr = core.kv_source.address if core.kv_source is not None else ""
        _send_blocking(outbox, EngineReady(os.getpid(), core.max_model_len, core.vocab_size,
                                           core.kv_capacity, sorted(core.eos_ids), kv_addr))
        logger.info("engine ready (pid %d)", os.getpid())
        loop.run()
        core.close()
        logger.info("engine stopped")
    finally:
        inbox.close()
        outbox.close()
        ctx.term()
    # Everything is closed: skip the interpreter's teardown of torch and its thread pools
    # (~1 s measured), so a stopped or restarted server is gone at once.
    logging.shutdown()
    os._exit(0)


def _send_blocking(sock: PushSocket, msg: EngineReady | EngineFailed,
                   timeout: float = 30.0) -> None:
    """The first message may go out before the connection is up: retry briefly."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock.send(msg)
            return
        except zmq.Again:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _spec_fields(spec: SpecStats | None) -> dict[str, object]:
    if spec is None:
        return {}
    return {"spec_num_drafts": spec.num_drafts, "spec_num_draft_tokens": spec.num_draft_tokens,
            "spec_num_accepted_tokens": spec.num_accepted_tokens,
            "spec_accepted_per_pos": list(spec.accepted_per_pos)}
