"""Which path takes long prefill chunks on a CPU with AMX: the native prefill kernel or SDPA,
decided by timing both once, at start-up, on the pool's own head shape.

The prefill kernel (cpu_prefill_attention.cpp) runs both of its products on vdpbf16ps: on Zen 4
a fresh 2,048-token bf16 prefill of SmolLM2's heads takes 16.2 ms (298 GFLOP/s, 70% of the
bf16 matmul peak) against SDPA's 40.1 ms (benchmarks/prefill_attention.py, 2026-12-04). On
Intel Xeons with AMX, torch's SDPA (its flash kernel's batch-reduce GEMMs, oneDNN brgemm) runs
QK^T and PV on AMX tiles, whose bf16 matmul peak measured ~6x vdpbf16ps's on 2 cores (#13:
~2,400 GFLOP/s); vLLM-CPU's prefill attention takes that route. The kernel has no AMX path, so
on those CPUs the faster of the two is measured rather than assumed: one fresh prefill of
PROBE_TOKENS tokens through each, as the engine calls them (the kernel reading a paged pool,
SDPA given the chunk's own K/V), median of a few runs. Elsewhere (no AMX, a float32 or quantized
pool: SDPA would need a dequantized copy) the kernel keeps every chunk without a probe.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from banyan.kernels import native

logger = logging.getLogger(__name__)

PROBE_TOKENS = 1024  # a fresh prefill of this many tokens is timed on each path
PROBE_GROUP = 3  # query heads per KV head in the probe (SmolLM2's; Llama 3 8B has 4)
SDPA_MARGIN = 0.9  # SDPA takes the chunks only when it needs under 90% of the kernel's time


@dataclass(frozen=True, slots=True)
class PrefillTimes:
    kernel_s: float
    sdpa_s: float

    @property
    def sdpa_wins(self) -> bool:
        return self.sdpa_s < SDPA_MARGIN * self.kernel_s


def time_prefill_paths(kv_heads: int, head_dim: int, dtype: torch.dtype,
                       tokens: int = PROBE_TOKENS, group: int = PROBE_GROUP,
                       rounds: int = 3) -> PrefillTimes:
    """Median seconds of one layer's causal attention over a fresh `tokens`-token prefill, on
    the native prefill kernel and on SDPA (random inputs; nothing else runs meanwhile)."""
    from banyan.attention.torch_backend import sdpa_gqa

    gen = torch.Generator().manual_seed(0)
    heads = kv_heads * group
    q = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(tokens + 1, kv_heads, head_dim, generator=gen).to(dtype)  # slot 0: padding
    v = torch.randn(tokens + 1, kv_heads, head_dim, generator=gen).to(dtype)
    out = torch.empty_like(q)
    table = torch.arange(1, tokens + 1, dtype=torch.int32)[None]
    zero = torch.zeros(1, dtype=torch.int64)
    length = torch.tensor([tokens])
    scale = head_dim**-0.5

    def kernel() -> None:
        native.prefill_attention(q, k, v, table, zero, length, zero, length, scale, out)

    def sdpa() -> None:  # the views the SDPA path hands it (torch_backend._attend_extend)
        qi = q.transpose(0, 1).unsqueeze(0)
        ki, vi = (x[1:].transpose(0, 1).unsqueeze(0) for x in (k, v))
        sdpa_gqa(qi, ki, vi, None, True, scale)

    return PrefillTimes(_median_s(kernel, rounds), _median_s(sdpa, rounds))


def kernel_takes_prefills(kv_heads: int, head_dim: int, dtype: torch.dtype,
                          code_dtype: torch.dtype | None) -> bool:
    """Whether the prefill kernel should take the long chunks here (else the SDPA paths)."""
    if not (native.amx_here() and dtype == torch.bfloat16 and code_dtype in (None, dtype)):
        return True
    times = time_prefill_paths(kv_heads, head_dim, dtype)
    logger.info("prefill attention on this AMX CPU: a fresh %d-token prefill took %.2f ms in "
                "the native kernel, %.2f ms in SDPA: long chunks go to %s", PROBE_TOKENS,
                times.kernel_s * 1e3, times.sdpa_s * 1e3,
                "SDPA" if times.sdpa_wins else "the kernel")
    return not times.sdpa_wins


def _median_s(fn: Callable[[], None], rounds: int) -> float:
    fn()  # warm-up: first-call set-up (oneDNN's kernels are generated on first use)
    seconds = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds)
