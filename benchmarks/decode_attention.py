"""Decode attention alone, the native kernel over a pool of SmolLM2-135M's shape (30 layers, 9
heads, 3 KV heads, head dim 64, random K/V), for the decode steps of the canonical workloads:

- random: 64 requests x 192 keys each (the middle of a 128/128 run),
- shared-prefix: 8 groups x 8 requests over a 1,024-key shared prefix plus 100 keys of their
  own (the cascade: the prefix is read once per group),
- hot: the random step with every request reading the same 192 slots, not grouped, so the K/V
  stay in cache and only the kernel's own work is timed.

One step = the 30 layers' calls. Each case is timed `--rounds` times (best kept), the cases
interleaved round by round. Run it from two checkouts to compare kernels. With `--tiles` (bf16,
a CPU with AMX) every case runs a second time with the kernel's products on AMX tiles
(kernels/cpu_attend_tiles.h), interleaved with the vector loops' run:

    PYTHONPATH=<checkout> python benchmarks/decode_attention.py [--rounds 7] [--dtype bfloat16]
        [--tiles] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from banyan.attention.decode_tiles import tiles_mode
from banyan.attention.native_plan import native_attention, plan_native
from banyan.bench.offline import machine_info
from banyan.kernels import native
from banyan.mem.kv_pool import KVPool

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64  # SmolLM2-135M


def decode_step(rows: list[list[int]], dtype: torch.dtype, group: bool = True,
                kv_cache_dtype: str = "auto", hot: bool = False
                ) -> tuple[Callable[[], None], KVPool]:
    """A pool holding every slot the rows name (random K/V, stored as kv_cache_dtype) and a
    decode step of one token per row over them (grouped by shared prefixes or not) -> (a
    callable running its attention in every layer, the pool); hot: every layer's call on layer
    0's K/V, which then stays in cache. benchmarks/kv_quant.py and decode_attention_phases.py
    time their steps with this too."""
    slots = max(max(r) for r in rows) + 1
    pool = KVPool.named(LAYERS, slots, KV_HEADS, HEAD_DIM, dtype, "cpu", kv_cache_dtype)
    gen = torch.Generator().manual_seed(0)
    every = torch.arange(slots)
    for layer in range(LAYERS):
        k, v = (torch.randn(slots, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
                for _ in range(2))
        pool.store(layer, every, k, v)
    table = torch.tensor(rows, dtype=torch.int32)
    n = len(rows)
    ctx = len(rows[0])
    plan = plan_native(table, list(range(n)), [ctx - 1] * n, [1] * n, None,
                       max_shared=None if group else 0)
    q = torch.randn(n, HEADS, HEAD_DIM, generator=gen).to(dtype)
    out = torch.empty_like(q)
    layers = [pool.layer(0 if hot else i) for i in range(LAYERS)]

    def run() -> None:
        for kv in layers:
            native_attention(q, kv, table, plan, HEAD_DIM**-0.5, out)

    return run, pool


def workload_rows() -> tuple[list[list[int]], list[list[int]]]:
    """The table rows of the random step (64 x 192 own keys) and of the shared-prefix one (8
    groups x 8 over 1,024 shared keys + 100 own)."""
    random_rows = [list(range(1 + 192 * i, 1 + 192 * (i + 1))) for i in range(64)]
    shared_rows = []
    for g in range(8):
        prefix = list(range(1 + 1024 * g, 1 + 1024 * (g + 1)))
        for m in range(8):
            start = 1 + 8 * 1024 + 100 * (8 * g + m)
            shared_rows.append(prefix + list(range(start, start + 100)))
    return random_rows, shared_rows


def cases(dtype: torch.dtype) -> dict[str, tuple[Callable[[], None], int]]:
    """name -> (the step, key-heads it reads: requests x keys x KV heads x layers)."""
    random_rows, shared_rows = workload_rows()
    hot_rows = [list(range(1, 193))] * 64
    heads = KV_HEADS * LAYERS
    return {"random 64 x 192": (decode_step(random_rows, dtype)[0], 64 * 192 * heads),
            "shared-prefix 8 x 8, 1024 + 100": (decode_step(shared_rows, dtype)[0],
                                                64 * 1124 * heads),
            "hot 64 x 192 (in cache)": (decode_step(hot_rows, dtype, group=False)[0],
                                        64 * 192 * heads)}


def on_tiles(fn: Callable[[], None]) -> Callable[[], None]:
    """fn with the row kernel's products on AMX tiles, the vector loops put back after."""

    def run() -> None:
        with tiles_mode(2):
            fn()

    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--tiles", action="store_true",
                        help="every case on AMX tiles too (bf16 on a CPU with AMX)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.tiles and not (args.dtype == "bfloat16" and native.prefill_tiles() == 2):
        parser.error("--tiles needs --dtype bfloat16 and a CPU with AMX tiles granted")
    with torch.inference_mode():
        steps = cases(getattr(torch, args.dtype))
        if args.tiles:
            steps |= {f"{name}, AMX tiles": (on_tiles(fn), key_heads)
                      for name, (fn, key_heads) in steps.items()}
        best = {name: float("inf") for name in steps}
        for fn, _ in steps.values():
            fn()  # warm up
        for _ in range(args.rounds):
            for name, (fn, _) in steps.items():
                t0 = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t0)
    results = []
    for name, (_, key_heads) in steps.items():
        ms = best[name] * 1e3
        # per core: the kernel runs on torch's threads
        ns = best[name] * 1e9 * torch.get_num_threads() / key_heads
        results.append({"case": name, "ms_per_step": round(ms, 3),
                        "core_ns_per_key_head": round(ns, 2)})
        print(f"{name:34s} {ms:8.2f} ms a step   {ns:6.2f} core-ns a key and KV head")
    if args.out:
        args.out.write_text(json.dumps({
            "command": "python " + " ".join(sys.argv), "dtype": args.dtype,
            "threads": torch.get_num_threads(), "machine": machine_info(),
            "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
