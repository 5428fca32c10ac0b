"""Prometheus metrics of the server, named in vLLM's style with a `banyan:` prefix (and, beside
them, vLLM's own `vllm:` names: banyan/server/vllm_metrics.py).

Two sources:
- request latencies (time to first token, inter-token latency, end to end) and finished requests
  by reason are measured here, in the API server, where the client's view of time is;
- engine state (running/waiting, KV usage, token and prefix-cache counters, retractions, the step
  time split) comes with every engine output message as an `EngineStats` snapshot of cumulative
  values, exported by a custom collector at scrape time (counters that the engine owns cannot be
  `inc()`-ed here without double counting).

Everything lives in one registry per server object (no module-level global registry).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from banyan.server.ipc import EngineStats, StepTimes
from banyan.server.vllm_metrics import VllmMetrics

# vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards built for vLLM read ours.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
FINISH_REASONS = ("stop", "length", "abort", "error")
PHASES = ("schedule", "prepare", "forward", "sample", "output", "other")


HICACHE_COUNTERS = {
    "saved_blocks": "KV blocks written to the tier (write-through of computed prompt chunks "
                    "and of requests' KV when they end).",
    "saved_bytes": "Bytes written to the tier.",
    "dropped_blocks": "Blocks not written: the write queue was full.",
    "loaded_blocks": "Blocks loaded from the tier into the KV pool.",
    "loaded_tokens": "Prompt tokens loaded from the tier instead of computed.",
    "loaded_bytes": "Bytes read from the tier.",
    "load_seconds": "Time spent loading blocks from the tier.",
    "recompute_preferred": "Tier hits left unused: recomputing was estimated faster.",
    "evicted_files": "Block files deleted to keep the tier within its budget.",
    "corrupt_files": "Block files that failed their check on load (deleted, recomputed).",
}


class ServerMetrics:
    def __init__(self, model_name: str, cache_info: dict[str, str] | None = None) -> None:
        """cache_info: labels of vllm:cache_config_info (block_size, enable_prefix_caching,
        cache_dtype)."""
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        self.ttft = Histogram(
            "banyan:time_to_first_token_seconds", "Time from request arrival to its first token.",
            labels, buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram(
            "banyan:inter_token_latency_seconds", "Time between two tokens of one sample.",
            labels, buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram(
            "banyan:e2e_request_latency_seconds", "Time from request arrival to its last token.",
            labels, buckets=LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self.queue_time = Histogram(
            "banyan:request_queue_time_seconds",
            "Time a request waited in the engine's queue before it was first scheduled.",
            labels, buckets=LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        success = Counter(
            "banyan:request_success", "Finished requests (samples) by finish reason.",
            ["model_name", "finished_reason"], registry=self.registry)
        self.finished = {r: success.labels(model_name, r) for r in FINISH_REASONS}
        self.engine = EngineStats()
        self.registry.register(_EngineCollector(self))
        self.vllm = VllmMetrics(self.registry, model_name, lambda: self.engine, cache_info or {})

    def count_finished(self, reason: str) -> None:
        self.finished.get(reason, self.finished["error"]).inc()
        self.vllm.count_finished(reason)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """The latest EngineStats snapshot, as gauges and counters."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        s = self._metrics.engine
        name = self._metrics.model_name

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric([name], value)
            return family

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric([name], value)
            return family

        yield gauge("banyan:num_requests_running", "Requests (samples) in the running batch.",
                    s.num_running)
        yield gauge("banyan:num_requests_waiting", "Requests (samples) waiting to be scheduled.",
                    s.num_waiting)
        yield gauge("banyan:kv_cache_usage_perc",
                    "Fraction of KV cache slots in use (1 = full); evictable cached prefixes "
                    "count as free.", s.kv_usage)
        yield gauge("banyan:kv_cache_capacity_tokens", "KV cache slots (tokens) in the pool.",
                    s.kv_capacity)
        yield gauge("banyan:kv_cache_free_tokens", "KV cache slots on the free list.", s.kv_free)
        yield gauge("banyan:prefix_cache_tokens",
                    "KV cache slots held by the prefix cache (evictable or locked).",
                    s.kv_evictable + s.kv_protected)
        yield counter("banyan:prompt_tokens", "Prompt tokens of admitted requests (cached ones "
                      "included).", s.prompt_tokens)
        yield counter("banyan:generation_tokens", "Generated tokens.", s.generation_tokens)
        yield counter("banyan:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queries)
        yield counter("banyan:prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                      s.prefix_cache_hits)
        yield counter("banyan:num_retractions",
                      "Running requests retracted because the KV cache was full (preemptions).",
                      s.retractions)
        yield counter("banyan:engine_steps", "Engine steps run.", s.steps)
        if s.spec_accepted_per_pos:  # speculative decoding is on (vLLM's spec_decode names)
            yield counter("banyan:spec_decode_num_drafts", "Verified drafts: one request's "
                          "guesses checked in one step.", s.spec_num_drafts)
            yield counter("banyan:spec_decode_num_draft_tokens", "Guessed tokens checked.",
                          s.spec_num_draft_tokens)
            yield counter("banyan:spec_decode_num_accepted_tokens", "Guessed tokens accepted.",
                          s.spec_num_accepted_tokens)
            per_pos = CounterMetricFamily(
                "banyan:spec_decode_num_accepted_tokens_per_pos",
                "Drafts whose guess at this position (0-based) was accepted.",
                labels=["model_name", "position"])
            for pos, n in enumerate(s.spec_accepted_per_pos):
                per_pos.add_metric([name, str(pos)], n)
            yield per_pos
        if s.hicache:  # the KV tier under the prefix cache
            for key, doc in HICACHE_COUNTERS.items():
                yield counter(f"banyan:hicache_{key}", doc, s.hicache.get(key, 0))
            yield gauge("banyan:hicache_bytes_used", "Bytes of block files in the KV tier.",
                        s.hicache.get("bytes_used", 0))
            yield gauge("banyan:hicache_read_bytes_per_second", "Measured load rate of the tier "
                        "(the load-or-recompute estimate).", s.hicache.get("read_bytes_per_s", 0))
            yield gauge("banyan:hicache_compute_tokens_per_second", "Measured prompt compute "
                        "rate (the load-or-recompute estimate; 0 until a prompt was computed).",
                        s.hicache.get("compute_tokens_per_s", 0))
        for key, value in s.disagg.items():  # P/D: the K/V transfer (disagg/source, sink.py)
            doc = DISAGG_COUNTERS.get(key)
            if doc is not None:
                yield counter(f"banyan:disagg_{key}", doc, value)
        if s.head_screen:  # a bf16 head read through its int8 screen (models/head_screen.py)
            yield counter("banyan:head_screen_steps", "One-token greedy steps whose token the "
                          "LM head's int8 screen proved.", s.head_screen[0])
            yield counter("banyan:head_screen_fallbacks", "One-token greedy steps the screen "
                          "could not decide (the whole head ran).", s.head_screen[1])
        phase = CounterMetricFamily(
            "banyan:step_phase_seconds",
            "Engine loop time by phase: schedule, prepare (inputs), forward, sample, output "
            "(handling the sampled tokens), other (receiving requests, sending outputs).",
            labels=["model_name", "phase"])
        for p in PHASES:
            phase.add_metric([name, p], getattr(s.times, p))
        yield phase
        yield counter("banyan:step_wall_seconds", "Wall time of engine loop iterations that ran "
                      "a step.", s.times.wall)
        yield counter("banyan:device_busy_seconds", "Time the device computed (forward and "
                      "sampling) within the step wall time.", s.times.busy)
        yield counter("banyan:execution_idle_seconds", "Step wall time the device waited on the "
                      "host (scheduling, input preparation, output handling, IPC).",
                      max(s.times.wall - s.times.busy, 0.0))
        yield gauge("banyan:device_busy_fraction", "Device-busy share of the wall time over the "
                    "recent steps (1 - execution-idle fraction).", s.busy_fraction)


DISAGG_COUNTERS = {
    "transfers": "decode worker: K/V fetches sent to prefill workers.",
    "received_tokens": "decode worker: prompt tokens whose K/V arrived from prefill workers.",
    "received_bytes": "decode worker: K/V bytes that arrived.",
    "transfer_seconds": "decode worker: fetch sent to K/V in the pool, summed over transfers.",
    "copy_seconds": "decode worker: copying received K/V into the pool (zmq backend).",
    "short_tokens": "decode worker: prompt tokens asked for and not received (computed here).",
    "failed": "decode worker: transfers refused, malformed or timed out (computed here).",
    "fetches": "prefill worker: K/V fetches answered.",
    "sent_tokens": "prefill worker: prompt tokens whose K/V was sent.",
    "sent_bytes": "prefill worker: K/V bytes sent.",
    "gather_seconds": "prefill worker: copying K/V out of the pool (zmq) or writing it to the "
                      "decode worker (mooncake).",
    "refused": "prefill worker: fetches refused (another model, no Mooncake engine).",
}


def step_times_dict(times: StepTimes) -> dict[str, float]:
    return {f: getattr(times, f) for f in StepTimes.__struct_fields__} | {"busy": times.busy}
