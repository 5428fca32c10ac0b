"""The router's Prometheus metrics (`banyan:router_*`), one registry per router (no globals).

Counters are counted as things happen; the per-worker state (health, in-flight requests, KV
usage, tree size) is read from the registry and the policy at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from banyan.router.policies import Decision
from banyan.router.workers import Worker

if TYPE_CHECKING:
    from banyan.router.pd import PrefillStage


class RouterMetrics:
    def __init__(self, policy: str, workers: Callable[[], list[Worker]],
                 tree_sizes: Callable[[], dict[str, int]],
                 prefill: PrefillStage | None = None) -> None:
        self.registry = CollectorRegistry()
        self.policy = policy
        self._decisions = Counter(
            "banyan:router_decisions",
            "Routing decisions by worker, policy and outcome (cache_aware: cache_hit, "
            "cache_miss, imbalance; other policies: their name). Retries count again.",
            ["worker", "policy", "outcome"], registry=self.registry)
        self._hits = Counter(
            "banyan:router_cache_affinity_hits",
            "Requests sent to a worker because its tree matched their prefix (cache_hit).",
            ["worker"], registry=self.registry)
        self._matched = Counter(
            "banyan:router_matched_prefix_symbols",
            "Key symbols (characters or token ids) of routed requests already in the chosen "
            "worker's tree: with router_key_symbols, the router's own estimate of the hit rate.",
            registry=self.registry)
        self._key = Counter("banyan:router_key_symbols",
                            "Key symbols of requests routed by the cache_aware policy.",
                            registry=self.registry)
        self._retries = Counter(
            "banyan:router_retries",
            "Requests retried on another worker, by the worker that failed them before any "
            "output, and why (connect, dropped, unavailable).",
            ["worker", "reason"], registry=self.registry)
        self._stream_errors = Counter(
            "banyan:router_stream_errors",
            "Responses cut because their worker failed after output started (the client got "
            "an error event).", ["worker"], registry=self.registry)
        self._unrouted = Counter(
            "banyan:router_unrouted_requests",
            "Requests answered 503: no healthy worker, or every one tried failed before "
            "output (--max-retries).",
            registry=self.registry)
        self.registry.register(_WorkerCollector(workers, tree_sizes))
        if prefill is not None:
            self.registry.register(_PrefillCollector(prefill))

    def decision(self, d: Decision) -> None:
        self._decisions.labels(d.url, self.policy, d.outcome).inc()
        if d.outcome == "cache_hit":
            self._hits.labels(d.url).inc()
        if d.key_len:
            self._matched.inc(d.matched)
            self._key.inc(d.key_len)

    def retry(self, url: str, reason: str) -> None:
        self._retries.labels(url, reason).inc()

    def stream_error(self, url: str) -> None:
        self._stream_errors.labels(url).inc()

    def unrouted(self) -> None:
        self._unrouted.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PrefillCollector(Collector):
    """--pd: the prefill stage's counters, read at scrape time."""

    def __init__(self, prefill: PrefillStage) -> None:
        self._prefill = prefill

    def collect(self) -> Iterator[Metric]:
        p = self._prefill
        yield CounterMetricFamily("banyan:router_pd_prefills", "Prompts computed by a prefill "
                                  "worker before their decode worker.", value=p.prefills)
        yield CounterMetricFamily("banyan:router_pd_fallbacks", "Requests no prefill worker "
                                  "could serve: their decode worker computed the prompt.",
                                  value=p.fallbacks)
        yield CounterMetricFamily("banyan:router_pd_prefill_seconds", "Time spent waiting "
                                  "for prefill workers (prompt computed, one token).",
                                  value=p.prefill_seconds)
        yield GaugeMetricFamily("banyan:router_pd_prefill_workers_healthy", "Prefill workers "
                                "taking traffic.", value=len(p.registry.candidates()))


class _WorkerCollector(Collector):
    def __init__(self, workers: Callable[[], list[Worker]],
                 tree_sizes: Callable[[], dict[str, int]]) -> None:
        self._workers = workers
        self._tree_sizes = tree_sizes

    def collect(self) -> Iterator[Metric]:
        workers = self._workers()
        sizes = self._tree_sizes()

        def family(name: str, doc: str, value: Callable[[Worker], float | None]) -> Metric:
            f = GaugeMetricFamily(name, doc, labels=["worker"])
            for w in workers:
                v = value(w)
                if v is not None:
                    f.add_metric([w.url], v)
            return f

        yield family("banyan:router_worker_healthy",
                     "1 when the worker takes traffic (healthy and not draining), else 0.",
                     lambda w: float(w.healthy and not w.draining))
        yield family("banyan:router_worker_draining", "1 while the worker is being removed.",
                     lambda w: float(w.draining))
        yield family("banyan:router_worker_in_flight", "Requests the router has open on the "
                     "worker.", lambda w: w.in_flight)
        yield family("banyan:router_worker_kv_usage", "The worker's KV cache usage (0..1) at "
                     "its last health check.", lambda w: w.kv_usage)
        yield family("banyan:router_worker_tree_symbols", "Key symbols the router remembers "
                     "as sent to the worker (cache_aware).", lambda w: sizes.get(w.url, 0))
