"""The tests' HTTP client: one for the whole session.

httpx's module functions (httpx.get, httpx.post, ...) build a client per call, and each client's
TLS context loads the CA bundle, even for http:// URLs: ~95 ms of CPU per request on a Zen 1
(0.4 ms through a client kept). Tests that polled a starting server every 0.1-0.2 s that way
took a third to a half of one of the machine's two cores from the server they waited for. This
client keeps no connection between requests (as the module functions do not) and has their
default timeout of 5 s; httpx's Client is safe to share between threads.
"""

from __future__ import annotations

import httpx

HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=5.0)
