"""Forwarding one request to a worker: choose, send, retry until the first output, then pass the
response through.

A request may be retried on another worker as long as nothing of its response has reached the
client: a refused or dropped connection, or a 503 (the worker's engine is down), before the
whole body (non-streamed) or before the first complete event (streamed). After that, a failure
ends a server-sent-event stream with an error event and `data: [DONE]`, as the worker itself
does when its engine dies.

Streams pass through unbuffered except for one thing: bytes after the last complete event
("\\n\\n") wait for the rest of their event, so a cut never leaves half an event before the error
event. The concatenated bytes are exactly the worker's.

The response is an ASGI callable (a Starlette Response subclass): it watches for the client
going away and then cancels the upstream request, which closes the connection to the worker,
which aborts the generation there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from banyan.router.args import RouterArgs
from banyan.router.keys import RouteKey
from banyan.router.metrics import RouterMetrics
from banyan.router.policies import Policy, least_loaded
from banyan.router.workers import Worker, WorkerRegistry
from banyan.server.errors import ApiError, error_body

if TYPE_CHECKING:
    from banyan.router.pd import PrefillStage

logger = logging.getLogger(__name__)

WORKER_HEADER = b"x-banyan-worker"
# Not forwarded: hop-by-hop headers, and those the next hop sets itself.
_REQUEST_DROP = frozenset({b"connection", b"keep-alive", b"proxy-authorization", b"te",
                           b"trailer", b"transfer-encoding", b"upgrade", b"host",
                           b"content-length"})
_RESPONSE_DROP = frozenset({b"connection", b"keep-alive", b"transfer-encoding",
                            b"content-length", b"date", b"server"})
_EVENT_END = b"\n\n"


class _Retryable(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # connect | dropped | unavailable
        self.message = message


@dataclass(slots=True)
class _Opened:
    """A worker's response, headers in, first output read: from here on it is the client's."""

    response: httpx.Response
    head: bytes  # the whole body (non-streamed) or the first complete event(s) and any rest
    rest: AsyncIterator[bytes] | None  # streamed: the remaining raw chunks


@dataclass(slots=True)
class Upstream:
    """What to send to a worker: the client's request, re-addressed."""

    method: str
    path: str  # with the query string
    headers: list[tuple[bytes, bytes]]
    body: bytes
    key: RouteKey | None
    routed: bool  # a generation request: chosen by the policy (else: any worker, least loaded)


def forward_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in raw if k.lower() not in _REQUEST_DROP]


def sse_error_event(status: int, message: str) -> bytes:
    return b"data: " + json.dumps(error_body(status, message)).encode() + b"\n\ndata: [DONE]\n\n"


class Proxy:
    def __init__(self, args: RouterArgs, registry: WorkerRegistry, policy: Policy,
                 metrics: RouterMetrics, client: httpx.AsyncClient,
                 prefill: PrefillStage | None = None) -> None:
        self.args = args
        self.prefill = prefill  # --pd: prompts go to a prefill worker first
        self.registry = registry
        self.policy = policy
        self.metrics = metrics
        self.client = client
        self._checks: set[asyncio.Task[None]] = set()  # keep references: tasks are weak

    def response(self, upstream: Upstream) -> Response:
        return ProxyResponse(self, upstream)

    def pick(self, up: Upstream, tried: set[str]) -> Worker | None:
        if not up.routed:
            workers = self.registry.candidates(tried)
            if not workers:
                return None
            url = least_loaded([w.candidate() for w in workers], self.args.kv_load_weight).url
            return next(w for w in workers if w.url == url)
        chosen = self.registry.choose(self.policy, up.key, tried)
        if chosen is None:
            return None
        self.metrics.decision(chosen[1])
        return chosen[0]

    def _suspect(self, worker: Worker, error: str) -> None:
        """A dropped connection may be a dead worker or a keep-alive race: check it now, and take
        it out at once if the check fails too."""
        async def verify() -> None:
            if not await self.registry.check(worker):
                self.registry.mark_failed(worker, error)

        task = asyncio.get_running_loop().create_task(verify())
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def open(self, worker: Worker, up: Upstream) -> _Opened:
        """The worker's response, or _Retryable; also as soon as the health checks take the
        worker out (a hung worker never answers, and --worker-timeout is long)."""
        down = worker.down
        if down.is_set():
            raise _Retryable("unavailable", "the worker is out of rotation")
        opening = asyncio.ensure_future(self._open(worker, up))
        watch = asyncio.ensure_future(down.wait())
        try:
            await asyncio.wait({opening, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not opening.done():
                opening.cancel()  # closes the connection: the worker aborts the request
                with contextlib.suppress(asyncio.CancelledError):
                    await opening
        if opening.cancelled():
            raise _Retryable("unavailable", "the worker failed its health checks")
        return opening.result()

    async def _open(self, worker: Worker, up: Upstream) -> _Opened:
        try:
            request = self.client.build_request(up.method, worker.url + up.path,
                                                headers=up.headers, content=up.body)
        except httpx.InvalidURL as exc:
            raise ApiError(400, f"invalid request path: {exc}") from None
        try:
            response = await self.client.send(request, stream=True)
        except httpx.ConnectError as exc:
            raise _Retryable("connect", f"cannot connect: {exc}") from None
        except httpx.TransportError as exc:
            raise _Retryable("dropped", f"{type(exc).__name__}: {exc}") from None
        try:
            if response.status_code == 503:
                raise _Retryable("unavailable", "the worker answered 503")
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                rest = response.aiter_raw()
                head = b""
                async for chunk in rest:
                    head += chunk
                    if _EVENT_END in head:
                        break
                return _Opened(response, head, rest)
            return _Opened(response, await response.aread(), None)
        except httpx.TransportError as exc:
            await response.aclose()
            raise _Retryable("dropped", f"{type(exc).__name__}: {exc}") from None
        except BaseException:
            await response.aclose()
            raise

    async def run(self, up: Upstream, send: Send) -> None:
        if self.prefill is not None and up.routed:
            up = await self.prefill.run(up)
        tried: set[str] = set()
        last_error = "no healthy worker"
        for _ in range(self.args.max_retries + 1):
            worker = self.pick(up, tried)
            if worker is None:
                break
            self.registry.acquire(worker)
            try:
                try:
                    opened = await self.open(worker, up)
                except _Retryable as exc:
                    last_error = f"{worker.url}: {exc.message}"
                    logger.warning("request to %s failed before output (%s): retrying",
                                   worker.url, exc.message)
                    self.metrics.retry(worker.url, exc.reason)
                    tried.add(worker.url)
                    if exc.reason == "dropped":
                        self._suspect(worker, exc.message)
                    else:
                        self.registry.mark_failed(worker, exc.message)
                    continue
                await self.deliver(worker, opened, send)
                return
            finally:
                self.registry.release(worker)
        self.metrics.unrouted()
        body = json.dumps(error_body(503, f"no worker could serve the request ({last_error})"))
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body.encode()})

    async def deliver(self, worker: Worker, opened: _Opened, send: Send) -> None:
        response = opened.response
        headers = [(k, v) for k, v in response.headers.raw if k.lower() not in _RESPONSE_DROP]
        headers.append((WORKER_HEADER, worker.url.encode()))
        try:
            if opened.rest is None:
                headers.append((b"content-length", str(len(opened.head)).encode()))
                await send({"type": "http.response.start", "status": response.status_code,
                            "headers": headers})
                await send({"type": "http.response.body", "body": opened.head})
                return
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": headers})
            pending = await self._send_events(opened.head, send)
            try:
                async for chunk in opened.rest:
                    pending = await self._send_events(pending + chunk, send)
            except httpx.TransportError as exc:
                logger.warning("worker %s failed mid-stream: %s", worker.url, exc)
                self.metrics.stream_error(worker.url)
                self._suspect(worker, f"{type(exc).__name__}: {exc}")
                await send({"type": "http.response.body", "more_body": False,
                            "body": sse_error_event(503, f"the worker serving this stream "
                                                         f"failed: {type(exc).__name__}")})
                return
            await send({"type": "http.response.body", "body": pending, "more_body": False})
        finally:
            await response.aclose()

    @staticmethod
    async def _send_events(data: bytes, send: Send) -> bytes:
        """Send the complete events in `data`; return the incomplete rest."""
        cut = data.rfind(_EVENT_END)
        if cut < 0:
            return data
        cut += len(_EVENT_END)
        await send({"type": "http.response.body", "body": data[:cut], "more_body": True})
        return data[cut:]


class ProxyResponse(Response):
    def __init__(self, proxy: Proxy, upstream: Upstream) -> None:
        super().__init__()
        self.proxy = proxy
        self.upstream = upstream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        work = asyncio.create_task(self.proxy.run(self.upstream, send))
        gone = asyncio.create_task(_client_gone(receive))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, gone):
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
        if not work.cancelled():
            work.result()  # re-raise what went wrong in there


async def _client_gone(receive: Receive) -> None:
    """The body was read already: the next message is the disconnect (uvicorn also sends it once
    the response is complete, when it no longer matters)."""
    while (await receive())["type"] != "http.disconnect":
        pass
