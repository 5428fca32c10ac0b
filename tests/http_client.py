"""The tests' HTTP client: one per thread for the whole session.

httpx's module functions (httpx.get, httpx.post, ...) build a client per call, and each client's
TLS context loads the CA bundle, even for http:// URLs: ~95 ms of CPU per request on a Zen 1
(0.4 ms through a client kept). Tests that polled a starting server every 0.1-0.2 s that way
took a third to a half of one of the machine's two cores from the server they waited for. This
client keeps no connection between requests (as the module functions do not) and has their
default timeout of 5 s. Each thread gets its own: one client shared by 8 threads sending a
burst of requests once failed a read with EBADF (a socket closed under it by another thread's
request in the client's pool; the server saw nothing wrong).
"""

from __future__ import annotations

import threading
from typing import Any

import httpx


class _ClientPerThread:
    """httpx.Client's methods (get, post, stream, ...) on the calling thread's own client."""

    def __init__(self) -> None:
        self._local = threading.local()

    def _client(self) -> httpx.Client:
        client = getattr(self._local, "client", None)
        if client is None:
            client = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=5.0)
            self._local.client = client
        return client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client(), name)


HTTP: Any = _ClientPerThread()
