"""`banyan bench serve` against a `route --pd` router: where the time to first token went.

Counters read before and after the run: the router's time in the prefill stage
(`banyan:router_pd_prefill_seconds`, per prefilled request: the prefill worker computing the
prompt, queueing included, and the HTTP round trip) and the decode workers' transfer time
(`banyan:disagg_transfer_seconds`, per transfer: fetch sent to K/V in the pool). The first
decode is what is left of the mean TTFT. Means over the run, not per request: a split of each
request would need timings inside every response.
"""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROUTER = {"prefills": "banyan:router_pd_prefills", "prefill_s": "banyan:router_pd_prefill_seconds",
          "fallbacks": "banyan:router_pd_fallbacks"}
DECODE = {"transfers": "banyan:disagg_transfers",
          "transfer_s": "banyan:disagg_transfer_seconds"}


def _sums(url: str, names: dict[str, str], headers: dict[str, str]) -> dict[str, float] | None:
    """The counters' totals at url (None: it has none of them)."""
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
    if not any(name in text for name in names.values()):
        return None
    wanted = {v: k for k, v in names.items()}
    out = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        key = wanted.get(family.name)
        for sample in family.samples:
            if key is not None and sample.name in (family.name, family.name + "_total"):
                out[key] += sample.value
    return out


def snapshot(base_url: str, headers: dict[str, str]) -> dict[str, float] | None:
    """The counters now, or None when base_url is not a P/D router."""
    try:
        router = _sums(base_url, ROUTER, headers)
        if router is None:
            return None
        router.update(dict.fromkeys(DECODE, 0.0))
        workers = httpx.get(f"{base_url}/workers", headers=headers, timeout=10).json()
        for w in workers.get("workers", []):
            for key, value in (_sums(w["url"], DECODE, headers) or {}).items():
                router[key] += value
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    return router


def ttft_split(before: dict[str, float] | None, after: dict[str, float] | None,
               mean_ttft_s: float | None) -> dict[str, Any] | None:
    """Mean prefill, transfer and first-decode seconds of the run (None: not a P/D router)."""
    if before is None or after is None or mean_ttft_s is None:
        return None
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    prefill = d["prefill_s"] / d["prefills"] if d["prefills"] else 0.0
    transfer = d["transfer_s"] / d["transfers"] if d["transfers"] else 0.0
    return {"prefill_s": prefill, "transfer_s": transfer,
            "first_decode_s": max(mean_ttft_s - prefill - transfer, 0.0),
            "prefills": int(d["prefills"]), "transfers": int(d["transfers"]),
            "fallbacks": int(d["fallbacks"])}
