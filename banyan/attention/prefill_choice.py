"""Which path takes long prefill chunks on a CPU with AMX: the native prefill kernel (its
products on AMX tiles where they check out) or SDPA, decided by timing both once, at start-up,
on the pool's own head shape.

The prefill kernel (cpu_prefill_attention.cpp) runs both of its products on vdpbf16ps: on Zen 4
a fresh 2,048-token bf16 prefill of SmolLM2's heads takes 16.2 ms (298 GFLOP/s, 70% of the
bf16 matmul peak) against SDPA's 40.1 ms (benchmarks/prefill_attention.py, 2026-12-04). On
Intel Xeons with AMX, torch's SDPA (its flash kernel's batch-reduce GEMMs, oneDNN brgemm) runs
QK^T and PV on AMX tiles, whose bf16 matmul peak measured ~6x vdpbf16ps's on 2 cores (#13:
~2,400 GFLOP/s); vLLM-CPU's prefill attention takes that route. So does the kernel's tile path
(cpu_prefill_tiles.h), written on CPUs without AMX and checked there against tiles emulated in
memory: on an AMX CPU it takes chunks only once its output on random inputs has matched the
pair path's (bf16 rounding apart). Then the faster of the kernel and SDPA is measured rather
than assumed: one fresh prefill of PROBE_TOKENS tokens through each, as the engine calls them
(the kernel reading a paged pool, SDPA given the chunk's own K/V), median of a few runs.
Elsewhere (no AMX, a float32 or quantized pool: SDPA would need a dequantized copy) the kernel
keeps every chunk without a probe.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache

import torch

from banyan.kernels import attention_kernels, native

logger = logging.getLogger(__name__)

PROBE_TOKENS = 1024  # a fresh prefill of this many tokens is timed on each path
PROBE_GROUP = 3  # query heads per KV head in the probe (SmolLM2's; Llama 3 8B has 4)
# The start-up probes' one rule (this module's, decode_tiles.py's, layers/gemm_tiles.py's): the
# other path replaces the one a process would take only when it needs under this share of its
# time. A tie keeps the default: a probe run while other processes time-slice the cores (a
# benchmark's peers starting beside the engine) measured the GEMM's two paths at the same
# 23.99 ms, and the vector loop kept that way ran a whole run's batched GEMMs at ~5x the time.
PROBE_MARGIN = 0.9


def clearly_faster(challenger_s: float, default_s: float) -> bool:
    """Whether a probe's challenger beat the default path by PROBE_MARGIN."""
    return challenger_s < PROBE_MARGIN * default_s


@dataclass(frozen=True, slots=True)
class PrefillTimes:
    kernel_s: float
    sdpa_s: float

    @property
    def sdpa_wins(self) -> bool:
        return clearly_faster(self.sdpa_s, self.kernel_s)


@dataclass(frozen=True, slots=True)
class PrefillRoute:
    tiles: int  # the kernel's products: 2 on AMX tiles, 0 its vector paths
    fresh_on_sdpa: bool  # fresh long chunks to SDPA (chunks over a cached prefix: the kernel)


@dataclass(slots=True)
class _Probe:
    """One layer's fresh `tokens`-token prefill (random inputs), as the engine calls each path."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    table: torch.Tensor  # the request's slots 1..tokens (slot 0: padding)
    length: torch.Tensor

    @classmethod
    def make(cls, kv_heads: int, head_dim: int, dtype: torch.dtype, tokens: int,
             group: int) -> _Probe:
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(tokens, kv_heads * group, head_dim, generator=gen).to(dtype)
        k, v = (torch.randn(tokens + 1, kv_heads, head_dim, generator=gen).to(dtype)
                for _ in range(2))
        table = torch.arange(1, tokens + 1, dtype=torch.int32)[None]
        return cls(q, k, v, table, torch.tensor([tokens]))

    def kernel(self, tiles: int = 0) -> torch.Tensor:
        zero = torch.zeros(1, dtype=torch.int64)
        return attention_kernels.prefill_attention(self.q, self.k, self.v, self.table, zero,
                                                   self.length, zero, self.length,
                                                   self.q.shape[-1]**-0.5, torch.empty_like(self.q),
                                                   tiles=tiles)

    def sdpa(self) -> None:  # the views the SDPA path hands it (torch_backend._attend_extend)
        from banyan.attention.torch_backend import sdpa_gqa

        qi = self.q.transpose(0, 1).unsqueeze(0)
        ki, vi = (x[1:].transpose(0, 1).unsqueeze(0) for x in (self.k, self.v))
        sdpa_gqa(qi, ki, vi, None, True, self.q.shape[-1]**-0.5)


def time_prefill_paths(kv_heads: int, head_dim: int, dtype: torch.dtype,
                       tokens: int = PROBE_TOKENS, group: int = PROBE_GROUP,
                       rounds: int = 3, tiles: int = 0) -> PrefillTimes:
    """Median seconds of one layer's causal attention over a fresh `tokens`-token prefill, on
    the native prefill kernel (its products on `tiles`) and on SDPA (nothing else running)."""
    probe = _Probe.make(kv_heads, head_dim, dtype, tokens, group)
    return PrefillTimes(*alternating_medians([lambda: probe.kernel(tiles), probe.sdpa], rounds))


def tiles_agree(kv_heads: int, head_dim: int, tiles: int = 2, tokens: int = 300) -> bool:
    """Whether the kernel's output with its products on `tiles` is its pair path's on random
    bf16 inputs, to within what the two paths' different bf16 roundings allow."""
    probe = _Probe.make(kv_heads, head_dim, torch.bfloat16, tokens, PROBE_GROUP)
    want, got = probe.kernel().float(), probe.kernel(tiles).float()
    return bool(torch.isfinite(got).all()) and torch.allclose(got, want, atol=3e-2, rtol=3e-2)


@cache
def prefill_route(kv_heads: int, head_dim: int, dtype: torch.dtype,
                  code_dtype: torch.dtype | None) -> PrefillRoute:
    """Where long chunks go here (module docstring): AMX tiles where they check out; fresh
    chunks to SDPA where it measured faster. Once a process for each pool shape, as the other
    routes are: a second engine (a draft's, a test's) timed anew could land on the other path
    for the same prompts, with the other bits (a 27-token prompt's greedy text parted between
    two engines of one process on an AMX Xeon)."""
    if not (native.amx_here() and dtype == torch.bfloat16):
        return PrefillRoute(0, False)
    tiles = 0
    if native.prefill_tiles() != 2:
        logger.warning("AMX's tiles are not used by the native kernels here: %s", amx_refusal())
    elif head_dim % 32 == 0:
        tiles = 2 if tiles_agree(kv_heads, head_dim) else 0
        logger.log(logging.INFO if tiles else logging.WARNING,
                   "prefill attention on AMX tiles: %s", "checked, in use" if tiles else
                   "output differs from the vector path's, not used")
    if code_dtype not in (None, dtype):
        return PrefillRoute(tiles, False)
    times = time_prefill_paths(kv_heads, head_dim, dtype, tiles=tiles)
    logger.info("prefill attention on this AMX CPU: a fresh %d-token prefill took %.2f ms in "
                "the native kernel%s, %.2f ms in SDPA: long fresh chunks go to %s",
                PROBE_TOKENS, times.kernel_s * 1e3, " (tiles)" if tiles else "",
                times.sdpa_s * 1e3, "SDPA" if times.sdpa_wins else "the kernel")
    return PrefillRoute(tiles, times.sdpa_wins)


# Why a CPU with AMX runs none of the kernels' tile paths (cpu_amx_tiles.h: AmxState)
AMX_REFUSALS = ("CPUID shows no AMX-TILE and AMX-BF16",
                "Linux did not grant the tile state (a kernel before 5.16?)",
                "a first tile block died in a child process (SIGILL?)",
                "a first tile block came out other than its emulation's exact output")


def amx_refusal() -> str:
    lib = native.load()
    if lib is None or native.prefill_tiles() == 0:
        return "this build has no tile paths"
    return AMX_REFUSALS[lib.banyan_amx_state()]


def alternating_medians(fns: Sequence[Callable[[], object]], rounds: int) -> list[float]:
    """Median seconds of each of `fns`, timed in turns (a round calls each once, every other
    round in reverse order) after one warm-up call each (first-call set-up: oneDNN generates
    its kernels on first use). In turns, since these VMs' speed moves 2-3x within minutes (an
    AMX core's tile unit measured 11 and 32 ns a tdpbf16ps a few minutes apart): a probe timing
    one path's rounds and then the other's could crown the slower path."""
    for fn in fns:
        fn()
    seconds: list[list[float]] = [[] for _ in fns]
    for r in range(rounds):
        order = range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))
        for i in order:
            t0 = time.perf_counter()
            fns[i]()
            seconds[i].append(time.perf_counter() - t0)
    return [statistics.median(s) for s in seconds]
