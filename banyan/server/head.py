"""HEAD on every GET endpoint (RFC 9110: a server that answers GET should answer HEAD the same,
without the body). FastAPI's routes list only the methods declared, so `HEAD /metrics` was a
405 and uptime checkers and Prometheus probes that use HEAD saw a failure. This ASGI wrapper
runs a HEAD as the GET it mirrors and drops the body, keeping the status and headers
(Content-Length included: it is the length the GET would send)."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class HeadAsGet:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def send_without_body(message: Message) -> None:
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return  # swallow the chunks; the last (empty) one ends the response
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, send_without_body)


KV_SOURCE_HEADER = b"x-banyan-kv-source"


class KVSourceHeader:
    """A prefill worker names, on every response, where its K/V is fetched from: the P/D router
    reads it off the prefill response and hands it to the decode worker (kv_transfer_params)."""

    def __init__(self, app: ASGIApp, address: str) -> None:
        self.app = app
        self.header = (KV_SOURCE_HEADER, address.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_header)
