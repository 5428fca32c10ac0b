"""The API server's side of the engine: sends requests, routes the engine's outputs to per-request
queues (one background task reads the output socket), answers control calls, and notices at once
when the engine process dies (its process sentinel becomes readable in the event loop).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing.process
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from banyan.sampling.params import SamplingParams
from banyan.server.ipc import (
    AbortRequest,
    AddRequest,
    AsyncPullSocket,
    ControlReply,
    ControlRequest,
    EngineFailed,
    EngineReady,
    EngineStats,
    FromEngine,
    PushSocket,
    Shutdown,
    Update,
    UpdateBatch,
)
from banyan.server.metrics import ServerMetrics
from banyan.server.vllm_metrics import RequestTimes

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


class RequestRejected(ValueError):
    """The engine refused a request (bad input it alone could judge): HTTP 400."""


@dataclass(slots=True)
class EngineRequest:
    rid: str  # the caller's name for it (logs, responses); the engine gets an id of ours
    prompt_ids: list[int]
    params: SamplingParams
    namespace: str | None = None
    kv_source: str | None = None  # P/D decode worker: the prefill worker holding the K/V


class _Dead:
    """Queue marker: the engine died."""


class _Closed:
    """Queue marker: the stream was closed (client gone) while someone still reads it."""


_DEAD = _Dead()
_CLOSED = _Closed()


class Stream:
    """One API request's view of its engine requests (several prompts, each with n samples):
    (choice index, update) pairs, choice = prompt index * n + sample index."""

    def __init__(self, client: EngineClient, parents: list[str], num_choices: int) -> None:
        self._client = client
        self.parents = parents
        self.queue: asyncio.Queue[tuple[int, Update] | _Dead | _Closed] = asyncio.Queue()
        self.pending = set(range(num_choices))
        self.arrival = time.perf_counter()
        self._first: list[float | None] = [None] * num_choices
        self._last: list[float] = [self.arrival] * num_choices
        self._tokens = [0] * num_choices
        self._queued = [-1.0] * num_choices  # the engine's queue time, once it tells
        self.closed = False

    async def events(self) -> AsyncIterator[tuple[int, Update]]:
        """Updates until every choice finished or the stream is closed. EngineDeadError when the
        engine dies; RequestRejected when it refuses the request."""
        while self.pending:
            item = await self.queue.get()
            if isinstance(item, _Closed):
                return
            if isinstance(item, _Dead):
                raise EngineDeadError("the engine process is not running")
            index, update = item
            if index < 0:
                if update.refused == 400:
                    raise RequestRejected(update.error or "request rejected")
                raise RuntimeError(update.error or "the engine failed to add the request")
            if update.finish_reason is not None:
                self.pending.discard(index)
            yield index, update

    def on_update(self, index: int, update: Update, now: float) -> None:
        """Latency metrics, from the time the update reached the API server."""
        metrics = self._client.metrics
        if update.queue_time >= 0:
            self._queued[index] = update.queue_time
        if update.token_ids:
            self._tokens[index] += len(update.token_ids)
            first = self._first[index]
            if first is None:
                self._first[index] = now
                metrics.ttft.observe(now - self.arrival)
                metrics.vllm.ttft.observe(now - self.arrival)
            else:
                gap = (now - self._last[index]) / len(update.token_ids)
                for _ in update.token_ids:
                    metrics.itl.observe(gap)
                    metrics.vllm.token_gap(gap)
            self._last[index] = now
        if update.finish_reason is not None:
            metrics.e2e.observe(now - self.arrival)
            reason = "error" if update.error else update.finish_reason
            metrics.count_finished(reason)
            first = self._first[index]
            metrics.vllm.finish(RequestTimes(
                update.prompt_tokens, self._tokens[index],
                None if first is None else first - self.arrival,
                self._last[index] - self.arrival, now - self.arrival, self._queued[index]))

    def close(self) -> None:
        """Abort whatever is unfinished (client gone, error, cancellation) and stop routing.
        Synchronous on purpose: it runs in `finally` blocks of cancelled tasks."""
        if self.closed:
            return
        self.closed = True
        self._client._release(self)
        self.queue.put_nowait(_CLOSED)


class EngineClient:
    def __init__(self, process: multiprocessing.process.BaseProcess, inbox_addr: str,
                 outbox_addr: str, metrics: ServerMetrics) -> None:
        self.process = process
        self.metrics = metrics
        self._zctx = zmq.Context()
        self._actx = zmq.asyncio.Context()
        # The engine's inbox is our push side; its outbox our pull side. We bind both.
        self._push = PushSocket(self._zctx, inbox_addr, bind=True)
        self._pull = AsyncPullSocket(self._actx, outbox_addr, bind=True, kind=FromEngine)
        self.info: EngineReady | None = None
        self.dead = False
        self.closing = False
        self._routes: dict[str, tuple[Stream, int]] = {}  # engine rid -> (stream, choice)
        self._parents: dict[str, tuple[Stream, list[str]]] = {}  # user rid -> (stream, children)
        self._rpcs: dict[int, asyncio.Future[ControlReply]] = {}
        self._rpc_ids = itertools.count()
        self._rids = itertools.count()
        self._reader: asyncio.Task[None] | None = None
        self._watching = False
        self.on_dead: Callable[[], None] | None = None  # the engine died (not a shutdown)

    # ---- life cycle --------------------------------------------------------------------------

    async def wait_ready(self, timeout: float) -> EngineReady:
        """Wait for the engine's first message; RuntimeError if it fails or dies first."""
        loop = asyncio.get_running_loop()
        died: asyncio.Future[None] = loop.create_future()
        loop.add_reader(self.process.sentinel, lambda: died.done() or died.set_result(None))
        recv = asyncio.ensure_future(self._pull.recv())
        try:
            done, _ = await asyncio.wait({recv, died}, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            loop.remove_reader(self.process.sentinel)
        if recv in done:
            msg = recv.result()
            if isinstance(msg, EngineReady):
                self.info = msg
                self._start(loop)
                return msg
            if isinstance(msg, EngineFailed):
                raise RuntimeError(f"the engine failed to start: {msg.message}")
            raise RuntimeError(f"unexpected first message from the engine: {type(msg).__name__}")
        recv.cancel()
        if died.done():
            await _join(self.process, 2.0)  # the sentinel can be readable before waitpid is
            raise RuntimeError(f"the engine process exited during start-up "
                               f"(exit code {self.process.exitcode})")
        raise RuntimeError(f"the engine did not start within {timeout:.0f} s")

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._reader = loop.create_task(self._read_outputs())
        loop.add_reader(self.process.sentinel, self._on_engine_exit)
        self._watching = True

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine (ask, then terminate, then kill) and close the sockets."""
        self.closing = True
        if self._watching:
            asyncio.get_running_loop().remove_reader(self.process.sentinel)
            self._watching = False
        if self.process.is_alive():
            try:
                self._push.send(Shutdown())
            except zmq.Again:
                pass
            await _join(self.process, timeout)
        if self.process.is_alive():
            logger.warning("engine did not stop in %.0f s; terminating it", timeout)
            self.process.terminate()
            await _join(self.process, 5.0)
        if self.process.is_alive():
            self.process.kill()
            await _join(self.process, 5.0)
        self._mark_dead()
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        self._push.close()
        self._pull.close()
        self._zctx.term()
        self._actx.term()

    def _on_engine_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self.process.sentinel)
        self._watching = False
        self._mark_dead()
        if not self.closing:
            logger.error("the engine process died; requests fail with 503 now")
            # What its last snapshot said was running is not running any more.
            self.metrics.engine = EngineStats()
            if self.on_dead is not None:
                self.on_dead()

    def _mark_dead(self) -> None:
        if self.dead:
            return
        self.dead = True
        streams = {stream for stream, _ in self._parents.values()}
        for stream in streams:
            for _ in stream.pending:
                self.metrics.count_finished("error")
            stream.queue.put_nowait(_DEAD)
        self._routes.clear()
        self._parents.clear()
        for fut in self._rpcs.values():
            if not fut.done():
                fut.set_exception(EngineDeadError("the engine process is not running"))
        self._rpcs.clear()

    # ---- requests ----------------------------------------------------------------------------

    def submit(self, requests: Sequence[EngineRequest]) -> Stream:
        """Send requests (all with the same n) to the engine; their outputs come through one
        Stream. Close the stream when done (always: it aborts what is unfinished).

        The engine's request ids are made here, never taken from the user: the engine names the
        samples of a request with n > 1 `rid#k`, and a user rid "x#0" next to a user rid "x" with
        n = 2 would collide. Everything is encoded before anything is registered or sent, so a
        request the engine could not receive (RequestRejected) leaves no state behind."""
        if self.dead:
            raise EngineDeadError("the engine process is not running")
        n = requests[0].params.n if requests else 1
        rids = [f"{next(self._rids):x}" for _ in requests]
        try:
            payloads = [self._push.encode(AddRequest(rid, req.prompt_ids, req.params,
                                                     req.namespace, req.kv_source))
                        for rid, req in zip(rids, requests)]
        except (msgspec.EncodeError, OverflowError, TypeError, ValueError) as exc:
            raise RequestRejected(f"the request holds a value the engine cannot take: "
                                  f"{exc}") from None
        stream = Stream(self, rids, len(requests) * n)
        try:
            for p, (rid, payload) in enumerate(zip(rids, payloads)):
                children = [rid] if n == 1 else [f"{rid}#{k}" for k in range(n)]
                for k, child in enumerate(children):
                    self._routes[child] = (stream, p * n + k)
                self._parents[rid] = (stream, children)
                self._push.send_bytes(payload)
        except zmq.Again:
            stream.close()
            raise EngineDeadError("the engine is not connected") from None
        return stream

    def _release(self, stream: Stream) -> None:
        for rid in stream.parents:
            entry = self._parents.pop(rid, None)
            if entry is None:
                continue
            _, children = entry
            unfinished = [c for c in children if c in self._routes]
            for child in children:
                self._routes.pop(child, None)
            if unfinished and not self.dead:
                for _ in unfinished:
                    self.metrics.count_finished("abort")
                try:
                    self._push.send(AbortRequest(rid))
                except zmq.Again:
                    pass

    async def control(self, kind: str, timeout: float = 30.0) -> ControlReply:
        if self.dead:
            raise EngineDeadError("the engine process is not running")
        rpc_id = next(self._rpc_ids)
        fut: asyncio.Future[ControlReply] = asyncio.get_running_loop().create_future()
        self._rpcs[rpc_id] = fut
        try:
            self._push.send(ControlRequest(rpc_id, kind))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._rpcs.pop(rpc_id, None)

    # ---- the output reader -------------------------------------------------------------------

    async def _read_outputs(self) -> None:
        while True:
            try:
                msg = await self._pull.recv()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a bad message must not stop the reader
                logger.exception("could not read an engine message")
                continue
            if isinstance(msg, UpdateBatch):
                self._dispatch(msg)
            elif isinstance(msg, ControlReply):
                fut = self._rpcs.get(msg.id)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    def _dispatch(self, batch: UpdateBatch) -> None:
        now = time.perf_counter()
        self.metrics.engine = batch.stats
        self.metrics.vllm.engine_step(batch.stats)
        for wait in batch.queue_times:
            self.metrics.queue_time.observe(wait)
        for update in batch.updates:
            if update.refused:
                entry = self._parents.get(update.rid)
                if entry is not None:
                    stream, children = entry
                    for child in children:
                        self._routes.pop(child, None)
                    if update.refused != 400:
                        self.metrics.count_finished("error")
                    stream.queue.put_nowait((-1, update))
                continue
            route = self._routes.get(update.rid)
            if route is None:
                continue  # a request the client already gave up
            stream, index = route
            stream.on_update(index, update, now)
            if update.finish_reason is not None:
                del self._routes[update.rid]
            stream.queue.put_nowait((index, update))


async def _join(process: multiprocessing.process.BaseProcess, timeout: float) -> None:
    if process.pid is None:  # never started
        return
    deadline = time.monotonic() + timeout
    while process.is_alive() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    process.join(0)
