"""The router's workers: who they are, whether they are healthy, how loaded, and their
comings and goings at run time.

States: a worker is healthy (takes traffic), unhealthy (failed: taken out, health-checked at the
usual pace and back after one passed check), or draining (removed by DELETE /workers: no new
traffic; dropped from the registry when its last in-flight request ends). A newly added worker
starts unhealthy and is checked at once.

All of it runs on the router's event loop: no locks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import httpx

from banyan.router.args import RouterArgs, normalize_url
from banyan.router.keys import RouteKey
from banyan.router.policies import Candidate, Decision, Policy

logger = logging.getLogger(__name__)

KV_USAGE_METRIC = "banyan:kv_cache_usage_perc"


@dataclass(slots=True)
class Worker:
    url: str
    healthy: bool = False
    draining: bool = False
    in_flight: int = 0
    routed: int = 0
    kv_usage: float | None = None
    failures: int = 0  # consecutive failed checks
    last_error: str | None = None
    last_check: float | None = None  # time.time() of the last health check
    # Set when the worker is taken out: requests still waiting on it fail over at once (a hung
    # worker would otherwise hold them until --worker-timeout). A fresh one when it comes back.
    down: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def state(self) -> str:
        if self.draining:
            return "draining"
        return "healthy" if self.healthy else "unhealthy"

    def candidate(self) -> Candidate:
        return Candidate(self.url, self.in_flight, self.kv_usage, self.routed)

    def info(self) -> dict[str, Any]:
        return {"url": self.url, "state": self.state, "healthy": self.healthy,
                "in_flight": self.in_flight, "routed": self.routed, "kv_usage": self.kv_usage,
                "consecutive_failures": self.failures, "last_error": self.last_error,
                "last_check": self.last_check}


def parse_kv_usage(text: str) -> float | None:
    """The KV usage gauge from a worker's Prometheus text (the first sample, as a worker
    serves one model)."""
    for line in text.splitlines():
        if line.startswith(KV_USAGE_METRIC) and line[len(KV_USAGE_METRIC)] in "{ ":
            try:
                return float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                return None
    return None


class WorkerRegistry:
    def __init__(self, args: RouterArgs, client: httpx.AsyncClient,
                 on_lost: Callable[[str], None]) -> None:
        """`on_lost(url)`: the worker failed or was removed (its cache is no longer known)."""
        self.args = args
        self.client = client
        self.on_lost = on_lost
        self._workers: dict[str, Worker] = {}  # in insertion order: round robin's order

    # ---- membership --------------------------------------------------------------------------

    def get(self, url: str) -> Worker | None:
        return self._workers.get(url)

    def all(self) -> list[Worker]:
        return list(self._workers.values())

    def add(self, url: str) -> Worker:
        url = normalize_url(url)
        worker = self._workers.get(url)
        if worker is None:
            worker = self._workers[url] = Worker(url)
            logger.info("worker %s added", url)
        elif worker.draining:
            worker.draining = False  # added back before it drained: keep it
            logger.info("worker %s added back while draining", url)
        return worker

    def remove(self, url: str) -> Worker | None:
        """Stop sending it traffic; it leaves when its in-flight requests are done (at once if
        there are none). Returns the worker, or None if unknown."""
        worker = self._workers.get(normalize_url(url))
        if worker is None:
            return None
        worker.draining = True
        logger.info("worker %s draining (%d in flight)", worker.url, worker.in_flight)
        self._drop_if_drained(worker)
        return worker

    def _drop_if_drained(self, worker: Worker) -> None:
        if worker.draining and worker.in_flight == 0 and \
                self._workers.get(worker.url) is worker:
            del self._workers[worker.url]
            self.on_lost(worker.url)
            logger.info("worker %s removed", worker.url)

    def candidates(self, exclude: Collection[str] = ()) -> list[Worker]:
        return [w for w in self._workers.values()
                if w.healthy and not w.draining and w.url not in exclude]

    def choose(self, policy: Policy, key: RouteKey | None,
               exclude: Collection[str] = ()) -> tuple[Worker, Decision] | None:
        """The worker `policy` picks among those taking traffic (not in exclude), and why."""
        workers = self.candidates(exclude)
        if not workers:
            return None
        decision = policy.choose(key, [w.candidate() for w in workers])
        return next(w for w in workers if w.url == decision.url), decision

    def any_healthy(self) -> bool:
        return any(w.healthy and not w.draining for w in self._workers.values())

    # ---- load --------------------------------------------------------------------------------

    def acquire(self, worker: Worker) -> None:
        worker.in_flight += 1
        worker.routed += 1

    def release(self, worker: Worker) -> None:
        worker.in_flight -= 1
        self._drop_if_drained(worker)

    # ---- health ------------------------------------------------------------------------------

    def mark_failed(self, worker: Worker, error: str) -> None:
        """A request found the worker down (refused or dropped connection, 503): out at once,
        rather than after the health checks notice."""
        worker.last_error = error
        worker.down.set()
        if worker.healthy:
            worker.healthy = False
            logger.warning("worker %s failed (%s): taken out", worker.url, error)
            # A worker that failed may come back restarted, with an empty cache: its
            # remembered prefixes would draw traffic it no longer has the cache for.
            self.on_lost(worker.url)

    async def check(self, worker: Worker) -> bool:
        """One health check: GET /health, then the KV usage from /metrics (best effort)."""
        timeout = self.args.health_check_timeout
        error: str | None = None
        try:
            # The whole check under one limit (httpx's applies to each read, not the total).
            async with asyncio.timeout(timeout):
                r = await self.client.get(f"{worker.url}/health", timeout=timeout)
            if r.status_code != 200:
                error = f"/health answered {r.status_code}"
        except httpx.HTTPError as exc:
            error = f"/health: {type(exc).__name__}: {exc}"
        except TimeoutError:
            error = f"/health: no answer within {timeout:g} s"
        worker.last_check = time.time()
        if error is None:
            try:
                async with asyncio.timeout(timeout):
                    r = await self.client.get(f"{worker.url}/metrics", timeout=timeout)
                if r.status_code == 200:
                    worker.kv_usage = parse_kv_usage(r.text)
            except (httpx.HTTPError, TimeoutError):
                pass  # load falls back to the in-flight count
            worker.failures = 0
            worker.last_error = None
            if not worker.healthy:
                logger.info("worker %s healthy", worker.url)
                worker.down = asyncio.Event()
            worker.healthy = True
            return True
        worker.failures += 1
        worker.last_error = error
        if worker.failures >= self.args.health_failure_threshold:
            self.mark_failed(worker, error)
        return False

    async def check_all(self) -> None:
        workers = list(self._workers.values())
        if workers:
            await asyncio.gather(*(self.check(w) for w in workers))

    async def run_checks(self) -> None:
        """Forever: check every worker each interval (failed ones too: that is the retry)."""
        while True:
            started = time.monotonic()
            try:
                await self.check_all()
            except Exception:  # noqa: BLE001 - the checker must outlive any one bad check
                logger.exception("health check pass failed")
            await asyncio.sleep(max(self.args.health_check_interval
                                    - (time.monotonic() - started), 0.05))
