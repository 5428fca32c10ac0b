"""Per-request records of a benchmark run and the summary computed from them: throughput,
TTFT, TPOT, inter-token latency and end-to-end latency percentiles, prefix-cache hit rate, and
the cross-check of token counts against the server's usage.

Definitions (those of vLLM's and SGLang's serving benchmarks):
- TTFT: from sending the request to the first chunk carrying output text.
- TPOT: per request, (latency - TTFT) / (output tokens - 1); requests with one token have none.
- ITL: the gaps between consecutive chunks carrying output text, pooled over all requests.
- Percentiles interpolate linearly between the closest ranks (numpy's default).
- Throughput: successful requests' tokens over the run's wall time (first send to last end).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestRecord:
    index: int  # the request's index in the workload
    prompt_tokens: int  # counted on our side (token ids sent, or the tokenizer on the text)
    max_tokens: int  # output tokens asked for (exactly this many with ignore_eos)
    group: int = 0
    parent: int | None = None
    exact: bool = True  # ignore_eos: the answer must have max_tokens (else: at most that)
    start: float = 0.0  # seconds from the start of the run to sending it
    ttft: float | None = None
    latency: float | None = None  # send to the end of the response
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0  # usage.completion_tokens when given, else the tokenizer's count
    output_tokens_tokenizer: int | None = None  # the output text re-encoded
    server_prompt_tokens: int | None = None  # usage.prompt_tokens
    server_completion_tokens: int | None = None  # usage.completion_tokens
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    finish_reason: str | None = None
    success: bool = False
    error: str | None = None
    http_status: int | None = None

    @property
    def tpot(self) -> float | None:
        if not self.success or self.ttft is None or self.latency is None:
            return None
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]
        out["tpot"] = self.tpot
        return out


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) with linear interpolation, as numpy.percentile."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    data = sorted(values)
    pos = (len(data) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def distribution(values: Sequence[float], scale: float = 1000.0) -> dict[str, float] | None:
    """mean, std, p50, p90, p99, max of `values` times `scale` (seconds -> ms by default)."""
    if not values:
        return None
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / len(values)
    out = {"mean": mean * scale, "std": math.sqrt(var) * scale}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(values, q) * scale
    out["max"] = max(values) * scale
    return out


def summarize(records: Sequence[RequestRecord], duration: float,
              reusable_tokens: int | None = None) -> dict[str, Any]:
    """The run's summary. Latencies are in milliseconds, throughputs per second of `duration`."""
    ok = [r for r in records if r.success]
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    with_cache = [r for r in ok if r.cached_tokens is not None]
    cached = sum(r.cached_tokens or 0 for r in with_cache)
    cached_prompt = sum(r.prompt_tokens for r in with_cache)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [t for t in (r.tpot for r in ok) if t is not None]
    itls = [gap for r in ok for gap in r.itl]
    e2e = [r.latency for r in ok if r.latency is not None]
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": _error_counts(records),
        "duration_s": duration,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "request_throughput": per_s(len(ok)),
        "input_tok_s": per_s(prompt),
        "output_tok_s": per_s(output),
        "total_tok_s": per_s(prompt + output),
        "ttft_ms": distribution(ttfts),
        "tpot_ms": distribution(tpots),
        "itl_ms": distribution(itls),
        "e2e_latency_ms": distribution(e2e),
        "cached_tokens": cached if with_cache else None,
        "prefix_hit_rate": cached / cached_prompt if with_cache and cached_prompt else None,
        "hit_rate_vs_optimum": (cached / reusable_tokens
                                if with_cache and reusable_tokens else None),
        "token_check": token_check(ok),
    }


def token_check(records: Sequence[RequestRecord]) -> dict[str, int]:
    """Our token counts against the server's usage: prompt tokens must be equal, and with
    ignore_eos every request must have produced exactly max_tokens (unless cut by the context),
    and never more without it."""
    prompt_checked = prompt_bad = out_checked = out_bad = 0
    for r in records:
        if r.server_prompt_tokens is not None:
            prompt_checked += 1
            prompt_bad += r.server_prompt_tokens != r.prompt_tokens
        if r.server_completion_tokens is not None:
            out_checked += 1
            out_bad += (r.server_completion_tokens != r.max_tokens if r.exact
                        else r.server_completion_tokens > r.max_tokens)
    return {"prompt_checked": prompt_checked, "prompt_mismatches": prompt_bad,
            "output_checked": out_checked, "output_mismatches": out_bad}


def _error_counts(records: Sequence[RequestRecord]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in records:
        if not r.success:
            key = (r.error or "unknown error")[:120]
            counts[key] = counts.get(key, 0) + 1
    return counts
