"""The blocked prefill attention kernel (banyan/kernels/cpu_prefill_attention.cpp) against torch
SDPA on the same shapes, and against the matmul peak measured in the same process.

Issue 13 asks that no CPU step use SDPA for attention, with the kernel clearly faster than SDPA
on a 2,048-token prefill. One layer of SmolLM2-135M's attention (9 query heads, 3 KV heads of
64) in float32 and bfloat16:

1. the peaks: torch.mm of 2,048^3 in float32 and bfloat16, best of ROUNDS;
2. fresh prefills of 512 / 1,024 / 2,048 tokens (SDPA: is_causal) and a 256-token chunk over
   2,048 cached tokens (SDPA: the offset causal mask the SDPA backend builds), the kernel reading
   K/V from a pool through a table as the engine does, SDPA given contiguous K/V (the engine's
   SDPA path also gathers them from the pool first: not counted here);
3. short chunks over 512 and 2,048 cached tokens, 4 to 64 tokens: the row kernel
   (cpu_paged_attention.cpp, which takes extends of up to `default_max_extend()` tokens)
   against the prefill kernel, which decides where one hands over to the other.

Every variant of a case runs once per round, interleaved, ROUNDS rounds; the fastest round is
kept (the median too). GFLOP/s count causal FLOPs: 4 x H x D x the keys each query row sees;
`of_peak` divides them by the higher of the two peaks. `--codes int8,fp8_e4m3` adds bf16
queries over a pool of those codes (the kernels read them with their scales, in place). On a
CPU with AMX the bf16 cases add `prefill_tiles`: the prefill kernel with its products on AMX
tiles (cpu_prefill_tiles.h).

    flock /tmp/banyan-cpu.lock python benchmarks/prefill_attention.py [--rounds 7] [--out FILE]
        [--codes int8,fp8_e4m3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from banyan.attention.native_plan import default_max_extend, plan_native
from banyan.bench.offline import command_line, machine_info
from banyan.kernels import attention_kernels, native
from banyan.mem.kv_pool import dequantize_rows, kv_code_dtype, quantize_rows

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M
LONG = [(0, 512), (0, 1024), (0, 2048), (2048, 256)]  # (cached tokens, new tokens)
SHORT = [(p, n) for p in (512, 2048) for n in (4, 8, 16, 32, 64)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def peak_gflops(dtype: torch.dtype, rounds: int) -> float:
    """torch.mm of 2,048^3, best of `rounds` calls after a warm-up; one call only where that
    takes seconds (bfloat16 without AVX512_BF16 / AMX is emulated: ~1 GFLOP/s on Zen 3)."""
    n = 2048
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    t0 = time.perf_counter()
    torch.mm(a, b)
    best = time.perf_counter() - t0
    for _ in range(rounds if best < 2.0 else 0):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def causal_flops(prefix: int, n: int) -> int:
    keys = n * prefix + n * (n + 1) // 2  # query j sees prefix + j + 1 keys
    return 4 * HEADS * HEAD_DIM * keys


def case(prefix: int, n: int, dtype: torch.dtype,
         codes: torch.dtype | None = None) -> dict[str, Callable[[], Any]]:
    """The variants of one shape: callables running one layer's attention (codes: the pool
    quantized to int8 / fp8, read with its scales; SDPA then gets the dequantized values)."""
    gen = torch.Generator().manual_seed(0)
    total = prefix + n
    # the pool as the engine holds it: slot 0 is padding, the request's tokens at 1..total
    k = torch.randn(total + 1, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(total + 1, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    q = torch.randn(n, HEADS, HEAD_DIM, generator=gen).to(dtype)
    pk, pv, k_scale, v_scale = k, v, None, None
    if codes is not None:
        (pk, k_scale), (pv, v_scale) = quantize_rows(k, codes), quantize_rows(v, codes)
        k, v = dequantize_rows(pk, k_scale, dtype), dequantize_rows(pv, v_scale, dtype)
    out = torch.empty_like(q)
    table = torch.arange(1, total + 1, dtype=torch.int32)[None]
    zero = torch.zeros(1, dtype=torch.int64)
    req_len, n_new = torch.tensor([total]), torch.tensor([n])
    scale = HEAD_DIM**-0.5

    def prefill_kernel() -> None:
        attention_kernels.prefill_attention(q, pk, pv, table, zero, req_len, zero, n_new, scale,
                                            out, k_scale, v_scale)

    plan = plan_native(table, [0], [prefix], [n], [0])

    def row_kernel() -> None:
        attention_kernels.paged_attention(q, pk, pv, table, plan.req_row, plan.req_len,
                                          plan.q_start, plan.n_new, plan.order, plan.group_start,
                                          plan.group_prefix, scale, out, k_scale, v_scale)

    qs = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    ks, vs = (x[1:].transpose(0, 1).unsqueeze(0) for x in (k, v))  # [1, KVH, total, D]
    mask = None if prefix == 0 else torch.ones((n, total), dtype=torch.bool).tril_(prefix)

    def sdpa() -> None:
        F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None,
                                       scale=scale, enable_gqa=True)

    def prefill_tiles() -> None:  # (AMX CPUs, bf16 queries: cpu_prefill_tiles.h)
        attention_kernels.prefill_attention(q, pk, pv, table, zero, req_len, zero, n_new, scale,
                                            out, k_scale, v_scale, tiles=2)

    return {"prefill_kernel": prefill_kernel, "prefill_tiles": prefill_tiles,
            "row_kernel": row_kernel, "sdpa": sdpa}


def timed(variants: dict[str, Callable[[], Any]], rounds: int) -> dict[str, dict[str, float]]:
    for fn in variants.values():  # warm-up
        fn()
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - t0)
    return {name: {"best_s": min(s), "median_s": statistics.median(s)}
            for name, s in seconds.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--codes", default="", help="also bf16 queries over a pool of these codes "
                    "(comma-separated: int8, fp8_e4m3, fp8_e5m2)")
    ns = ap.parse_args(argv)
    if native.load() is None:
        print("native kernels unavailable", file=sys.stderr)
        return 1
    peaks = {name: peak_gflops(dtype, ns.rounds) for name, dtype in DTYPES.items()}
    print(f"matmul 2048^3 peaks: float32 {peaks['float32']:.1f}, "
          f"bfloat16 {peaks['bfloat16']:.1f} GFLOP/s ({torch.get_num_threads()} threads)")
    # the higher of the two: bfloat16 is emulated (~1 GFLOP/s) on CPUs without AVX512_BF16 /
    # AMX, and the kernel computes in float32 whatever the dtype
    peak = max(peaks.values())
    rows = []
    for label, shapes, names in (("long", LONG, ("prefill_kernel", "sdpa")),
                                 ("short", SHORT, ("prefill_kernel", "row_kernel", "sdpa"))):
        pools = [(d, t, None) for d, t in DTYPES.items()] + [
            (f"bfloat16/{c}", torch.bfloat16, kv_code_dtype(c)) for c in ns.codes.split(",") if c]
        for dname, dtype, codes in pools:
            for prefix, n in shapes:
                variants = case(prefix, n, dtype, codes)
                tiles = dtype == torch.bfloat16 and native.prefill_tiles() == 2  # (AMX)
                wanted = (*names, "prefill_tiles") if tiles else names
                got = timed({k: variants[k] for k in wanted}, ns.rounds)
                flops = causal_flops(prefix, n)
                row: dict[str, Any] = {"set": label, "dtype": dname, "cached": prefix,
                                       "tokens": n, "gflop": flops / 1e9}
                for name, t in got.items():
                    row[name] = {"ms": t["best_s"] * 1e3, "median_ms": t["median_s"] * 1e3,
                                 "gflops": flops / t["best_s"] / 1e9,
                                 "of_peak": flops / t["best_s"] / 1e9 / peak}
                rows.append(row)
                cells = "  ".join(f"{name} {row[name]['ms']:8.2f} ms {row[name]['gflops']:6.1f}"
                                  for name in wanted)
                print(f"{dname:13} {prefix:5} cached + {n:5} new: {cells}  GFLOP/s", flush=True)
    result = {"command": command_line(), "machine": machine_info(),
              "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM},
              "rounds": ns.rounds, "default_max_extend": default_max_extend(),
              "vector_bits": native.vector_bits(), "peak_gflops": peaks, "cases": rows}
    if ns.out:
        ns.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
