"""vLLM-named metrics (`vllm:` prefix), always exported beside Banyan's own `banyan:` ones, so
Grafana dashboards and alerts written for vLLM work against `banyan serve` unchanged.

Names, types, labels and buckets follow vLLM's v1 Prometheus logger (vllm/v1/metrics/loggers.py):
engine gauges and counters (num_requests_running/waiting, kv_cache_usage_perc and its older
name gpu_cache_usage_perc, prompt/generation tokens, prefix cache queries/hits, preemptions,
cache_config_info) read from the latest EngineStats at scrape time, and per-request histograms
observed here: time to first token, inter-token latency (and its older name
time_per_output_token_seconds, the same per-token gaps), per-request time per output token, end
to end latency, queue/prefill/decode/inference time, prompt and generation tokens per request,
and tokens per engine iteration.

Per-request phases, as vLLM splits them: queue = arrival in the engine to first scheduled
(measured by the engine); prefill = first scheduled to first token; decode = first token to
last token; inference = prefill + decode. Prefill is the API server's time to first token less
the engine's queue time, so it includes the IPC hops (well under a millisecond).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from banyan.server.ipc import EngineStats

# vLLM's buckets (v1 loggers), so histogram_quantile over either server's series compares.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
FINISH_REASONS = ("stop", "length", "abort", "error")
# Token-count histograms go up to here (vLLM sizes them by max_model_len, which the API server
# learns only once the engine is up; 1-2-5 steps to 500k cover any context length served).
MAX_TOKEN_BUCKET = 500_000


def token_buckets(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to limit (vLLM's build_1_2_5_buckets)."""
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > limit:
                return out
            out.append(float(value))
        exponent += 1


@dataclass(slots=True)
class RequestTimes:
    """One finished sample, as the API server saw it (seconds, from its arrival)."""

    prompt_tokens: int
    generation_tokens: int
    first_token: float | None  # None: no token came
    last_token: float
    e2e: float
    queue: float  # -1: unknown (never admitted)


class VllmMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str,
                 engine: Callable[[], EngineStats], cache_info: dict[str, str]) -> None:
        """engine: the latest EngineStats; cache_info: vllm:cache_config_info's labels (the
        block count is added from the engine's KV capacity at scrape time)."""
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets,
                             registry=registry).labels(model_name)

        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds (the gaps between "
                              "tokens; the older name of inter_token_latency).", ITL_BUCKETS)
        self.request_tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.",
                               REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.",
                                 REQUEST_LATENCY_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.",
                                REQUEST_LATENCY_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.",
                                   REQUEST_LATENCY_BUCKETS)
        tokens = token_buckets(MAX_TOKEN_BUCKET)
        self.prompt_tokens = histogram("vllm:request_prompt_tokens",
                                       "Number of prefill tokens processed.", tokens)
        self.generation_tokens = histogram("vllm:request_generation_tokens",
                                           "Number of generation tokens processed.", tokens)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.",
                                          tokens)
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          ["model_name", "finished_reason"], registry=registry)
        self.finished = {r: success.labels(model_name, r) for r in FINISH_REASONS}
        self._steps_seen = 0
        registry.register(_VllmEngineCollector(model_name, engine, cache_info))

    def count_finished(self, reason: str) -> None:
        self.finished.get(reason, self.finished["error"]).inc()

    def finish(self, times: RequestTimes) -> None:
        """A sample that ended with an update (counted by count_finished separately: aborts
        and engine deaths end samples without one)."""
        self.e2e.observe(times.e2e)
        self.prompt_tokens.observe(times.prompt_tokens)
        self.generation_tokens.observe(times.generation_tokens)
        if times.queue >= 0:
            self.queue.observe(times.queue)
        if times.first_token is None:
            return
        prefill = max(times.first_token - max(times.queue, 0.0), 0.0)
        decode = times.last_token - times.first_token
        self.prefill.observe(prefill)
        self.decode.observe(decode)
        self.inference.observe(prefill + decode)
        if times.generation_tokens > 1:
            self.request_tpot.observe(decode / (times.generation_tokens - 1))

    def token_gap(self, gap: float) -> None:
        self.itl.observe(gap)
        self.tpot.observe(gap)

    def engine_step(self, stats: EngineStats) -> None:
        """Called with each stats snapshot: the tokens of a step not seen yet."""
        if stats.steps > self._steps_seen:
            self._steps_seen = stats.steps
            self.iteration_tokens.observe(stats.last_step.get("num_tokens", 0.0))
        elif stats.steps < self._steps_seen:  # a restarted engine counts from zero again
            self._steps_seen = stats.steps


class _VllmEngineCollector(Collector):
    def __init__(self, model_name: str, engine: Callable[[], EngineStats],
                 cache_info: dict[str, str]) -> None:
        self._name = model_name
        self._engine = engine
        self._cache_info = cache_info

    def collect(self) -> Iterator[Metric]:
        s = self._engine()
        name = self._name

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric([name], value)
            return family

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric([name], value)
            return family

        yield gauge("vllm:num_requests_running", "Number of requests in model execution "
                    "batches.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    s.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    s.kv_usage)
        yield gauge("vllm:gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage "
                    "(older name of kv_cache_usage_perc).", s.kv_usage)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                      s.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.",
                      s.generation_tokens)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number "
                      "of queried tokens.", s.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of "
                      "cached tokens.", s.prefix_cache_hits)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the "
                      "engine.", s.retractions)
        labels = dict(self._cache_info)
        block = int(labels.get("block_size", "1"))
        labels["num_gpu_blocks"] = str(s.kv_capacity // max(block, 1))
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine "
                                 "CacheConfig", labels=list(labels))
        info.add_metric(list(labels.values()), 1.0)
        yield info
