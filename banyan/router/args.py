"""Router arguments: one dataclass whose field docs are the `banyan route --help` text.

`banyan serve --dp N` takes the routing fields too (all but SERVE_SKIP, which ServerArgs already
has under the same names: the router listens where `serve` was told to listen).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields

from banyan.args import _doc

POLICIES = ["cache_aware", "round_robin", "shortest_queue", "random"]

# Fields of RouterArgs that `banyan serve` already has (from ServerArgs) or sets itself.
SERVE_SKIP = frozenset({"host", "port", "workers", "pd", "prefill_workers", "api_key", "log_level",
                        "max_request_bytes", "access_log", "request_body_timeout"})


@dataclass(slots=True)
class RouterArgs:
    host: str = field(default="127.0.0.1", metadata=_doc(
        "Address the router listens on (0.0.0.0: the network; set --api-key then)."))
    port: int = field(default=30000, metadata=_doc("TCP port the router listens on."))
    workers: list[str] = field(default_factory=list, metadata=_doc(
        "Engine replica base URLs (http://host:port); on the command line: --worker URL, "
        "repeatable. More can be added at run time with POST /workers."))
    pd: bool = field(default=False, metadata=_doc(
        "Prefill/decode disaggregation: each generation request is sent to a prefill worker "
        "(--prefill) for its prompt, then to a decode worker (--decode / --worker) that fetches "
        "the prompt's K/V from it and streams the answer. Workers are `banyan serve "
        "--disaggregation-mode prefill|decode`."))
    prefill_workers: list[str] = field(default_factory=list, metadata=_doc(
        "--pd: the prefill workers' base URLs; on the command line: --prefill URL, "
        "repeatable."))
    policy: str = field(default="cache_aware", metadata=_doc(
        "How a worker is chosen: cache_aware (longest approximate prefix match, else the "
        "least-loaded worker), round_robin, shortest_queue (least load), random.",
        choices=POLICIES))
    cache_threshold: float = field(default=0.3, metadata=_doc(
        "cache_aware: route to the worker with the longest prefix match only when the match "
        "covers more than this fraction of the request's prompt; otherwise to the least-loaded "
        "worker."))
    balance_abs_threshold: float = field(default=64.0, metadata=_doc(
        "cache_aware: the load is imbalanced (route to the least-loaded worker, ignoring cache "
        "affinity) when max load - min load exceeds this AND max > --balance-rel-threshold x "
        "min. Load: in-flight requests plus --kv-load-weight x KV usage."))
    balance_rel_threshold: float = field(default=1.5, metadata=_doc(
        "cache_aware: see --balance-abs-threshold."))
    kv_load_weight: float = field(default=4.0, metadata=_doc(
        "A worker's load is its in-flight requests plus this many times its KV cache usage "
        "(0..1, scraped from its /metrics): a full KV cache counts as this many more requests."))
    max_tree_size: int = field(default=1 << 24, metadata=_doc(
        "cache_aware: most prompt symbols (characters of text prompts, token ids of token "
        "prompts) remembered per worker; past it, least recently used prefixes are forgotten."))
    eviction_interval: float = field(default=30.0, metadata=_doc(
        "cache_aware: seconds between two passes that trim each worker's tree to "
        "--max-tree-size."))
    health_check_interval: float = field(default=1.0, metadata=_doc(
        "Seconds between health checks (GET /health, and /metrics for KV usage) of each "
        "worker, healthy or not: a failed worker is retried at this pace. With the defaults a "
        "hung worker is out of rotation within about 3 s (interval + 2 x timeout)."))
    health_check_timeout: float = field(default=1.0, metadata=_doc(
        "Seconds a health check may take before it counts as failed (a worker's /health does "
        "no work: a slow answer means a stuck process)."))
    health_failure_threshold: int = field(default=2, metadata=_doc(
        "Consecutive failed health checks that take a worker out (a refused connection or a 503 "
        "takes it out at once; a dropped connection when a check made right then fails too). "
        "One passed check brings it back."))
    max_retries: int = field(default=2, metadata=_doc(
        "Other workers a request is retried on when its worker fails before sending any "
        "output."))
    connect_timeout: float = field(default=5.0, metadata=_doc(
        "Seconds to connect to a worker."))
    worker_timeout: float = field(default=600.0, metadata=_doc(
        "Seconds a worker may go without sending anything (the response, or the next bytes of "
        "a stream) before the request is failed over to another worker (nothing sent to the "
        "client yet) or its stream ends with an error event. A non-streamed generation sends "
        "nothing until it is done: keep this above the longest one. Requests to a worker that "
        "fails its health checks are failed over at once, whatever this says."))
    api_key: str | None = field(default=None, metadata=_doc(
        "When set, every endpoint but /health and /metrics needs `Authorization: Bearer KEY`; "
        "the header is forwarded to the workers unchanged. Default: the BANYAN_API_KEY "
        "environment variable."))
    admin_api_key: str | None = field(default=None, metadata=_doc(
        "Key for changing the workers (POST and DELETE /workers): `Authorization: Bearer "
        "ADMIN_KEY`. Unset, those endpoints are refused (see --allow-admin-without-key). "
        "Default: the BANYAN_ADMIN_API_KEY environment variable."))
    allow_admin_without_key: bool = field(default=False, metadata=_doc(
        "Without --admin-api-key, accept POST/DELETE /workers from anyone who can reach the "
        "router, except from web pages (requests with an Origin or Sec-Fetch-Site header: a "
        "page in a user's browser must not re-point the router). For trusted networks only."))
    max_request_bytes: int = field(default=2 * 1024 * 1024, metadata=_doc(
        "Largest request body accepted, in bytes (larger: HTTP 413)."))
    request_body_timeout: float = field(default=30.0, metadata=_doc(
        "Seconds a client may take to send its request body (longer: HTTP 408)."))
    log_level: str = field(default="info", metadata=_doc(
        "Logging level.", choices=["debug", "info", "warning", "error"]))
    access_log: bool = field(default=False, metadata=_doc("Log one line per HTTP request."))

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        for name in ("balance_abs_threshold", "balance_rel_threshold", "kv_load_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("eviction_interval", "health_check_interval", "health_check_timeout",
                     "connect_timeout", "worker_timeout", "request_body_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_tree_size", "health_failure_threshold", "max_request_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.api_key is None:
            self.api_key = os.environ.get("BANYAN_API_KEY") or None
        if self.admin_api_key is None:
            self.admin_api_key = os.environ.get("BANYAN_ADMIN_API_KEY") or None
        if self.api_key == "" or self.admin_api_key == "":
            raise ValueError("api_key and admin_api_key must not be empty")
        self.workers = [normalize_url(u) for u in self.workers]
        self.prefill_workers = [normalize_url(u) for u in self.prefill_workers]
        if self.prefill_workers and not self.pd:
            raise ValueError("prefill workers are for --pd (prefill/decode disaggregation)")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace, **given: object) -> RouterArgs:
        """The fields the parser has (see add_dataclass_args' skip), plus `given`."""
        values = {n: getattr(ns, n) for n in cls.field_names() if hasattr(ns, n)}
        return cls(**{**values, **given})  # type: ignore[arg-type]


def normalize_url(url: str) -> str:
    """'127.0.0.1:30001/' -> 'http://127.0.0.1:30001': one spelling per worker."""
    url = url.strip().rstrip("/")
    if not url:
        raise ValueError("empty worker URL")
    if "://" not in url:
        url = "http://" + url
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"worker URL must be http(s)://host:port, got {url!r}")
    return url
