"""Two builds of the paged-attention kernel alternated call by call in one process (a drift of
these VMs' speed, 20-40% between runs, hits both alike), on SmolLM2-135M's heads (30 layers of
9 query x 3 KV heads of 64, bf16, random K/V): the decode steps of benchmarks/decode_attention.py
(random 64 x 192 keys, shared-prefix 8 x 8 over 1,024 + 100), benchmarks/kv_quant.py's 64 x
256 over int8 / fp8 pools, one request's lone decode and 13-token speculative check over 100 /
300 / 1,000 keys (batch 1), and one layer of the prefill kernel (benchmarks/prefill_attention.py:
a fresh 2,048-token prefill, 256 tokens over 2,048 cached, 64 over 1,024 as in shared-prefix).
Medians of --rounds calls.

Build the other checkout's kernels (any Banyan call that loads them writes the library into
~/.cache/banyan/kernels, named by a hash of the sources), then:

    python benchmarks/attention_ab.py A.so B.so [--rounds 41] [--out F] [--tiles] [--only S,...]

--tiles: the row kernel's products on AMX tiles in both builds (cpu_attend_tiles.h; a CPU with
AMX); the int8 / fp8 pools' cases keep the vector loops (the tiles read bf16 pools only); the
prefill cases run the prefill kernel's tile path (cpu_prefill_tiles.h), its pair path without.
--only: the cases whose names contain one of these strings ("shared,check": more rounds of a
few cases in the same time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from banyan.attention.native_plan import plan_native
from banyan.bench.offline import machine_info
from banyan.kernels import attention_kernels, native
from decode_attention import decode_step, workload_rows  # (this script's folder)
from kv_quant import decode_case
from prefill_attention import case as prefill_case
from two_builds import native_libraries, parse_args

HEADS, KV_HEADS, DIM, LAYERS = 9, 3, 64, 30


def lone(keys: int, tokens: int) -> Callable[[], None]:
    """One request's last `tokens` new tokens over `keys` keys in all (1: a decode)."""
    gen = torch.Generator().manual_seed(keys + tokens)
    k, v = (torch.randn(LAYERS, keys + 1, KV_HEADS, DIM, generator=gen).bfloat16()
            for _ in range(2))
    q = torch.randn(tokens, HEADS, DIM, generator=gen).bfloat16()
    out = torch.empty_like(q)
    table = torch.arange(1, keys + 1, dtype=torch.int32)[None]
    p = plan_native(table, [0], [keys - tokens], [tokens], [0])

    def run() -> None:
        for layer in range(LAYERS):
            attention_kernels.paged_attention(q, k[layer], v[layer], table, p.req_row, p.req_len,
                                   p.q_start, p.n_new, p.order, p.group_start, p.group_prefix,
                                   DIM**-0.5, out)
    return run


def cases(tiles: bool) -> dict[str, Callable[[], None]]:
    random_rows, shared_rows = workload_rows()
    # as the engine's allocator lays them out: each prompt's 128 slots in a run, then the 64
    # decoded tokens' slots one a step for all 64 requests (lowest free first: a stride of 64)
    engine_rows = [list(range(1 + 128 * i, 129 + 128 * i)) +
                   [1 + 128 * 64 + i + 64 * t for t in range(64)] for i in range(64)]
    out = {"64 decodes x 192 keys": decode_step(random_rows, torch.bfloat16)[0],
           "64 x (128 + 64 decoded), engine slots": decode_step(engine_rows, torch.bfloat16)[0],
           "shared-prefix 8 x 8, 1024 + 100": decode_step(shared_rows, torch.bfloat16)[0]}
    for kv in ("int8", "fp8_e4m3", "fp8_e5m2"):  # kv_quant.py's step: bf16 queries, codes
        out[f"64 decodes x 256 keys, {kv} pool"] = decode_case(torch.bfloat16, kv, 256)[0]
    for keys in (100, 300, 1000):
        out[f"lone decode, {keys} keys"] = lone(keys, 1)
        out[f"13-token check, {keys} keys"] = lone(keys, 13)
    for prefix, n in ((0, 2048), (2048, 256), (1024, 64)):  # the prefill kernel, one layer
        out[f"prefill {n} over {prefix}, 1 layer"] = prefill_case(
            prefix, n, torch.bfloat16)["prefill_tiles" if tiles else "prefill_kernel"]
    return out


def main() -> int:
    def more(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--tiles", action="store_true",
                        help="both builds' row kernel on AMX tiles (bf16 pools)")
        ap.add_argument("--only", default="", help="comma-separated parts of case names")

    ns = parse_args(__doc__, "1", 41, more)
    wanted = [part for part in ns.only.split(",") if part]
    libs = native_libraries(ns.a, ns.b)
    load = native.load
    results = []
    try:
        for lib in libs.values() if ns.tiles else ():  # (each library has its own mode)
            native.load = lambda lib=lib: lib  # type: ignore[assignment]
            if native.prefill_tiles() != 2 or native.set_decode_tiles(2) != 2:
                raise SystemExit("--tiles: AMX tiles refused here")
        with torch.inference_mode():
            for name, run in cases(ns.tiles).items():
                if wanted and not any(part in name for part in wanted):
                    continue
                seconds: dict[str, list[float]] = {"a": [], "b": []}
                for r in range(ns.rounds):
                    for lib in ("a", "b") if r % 2 == 0 else ("b", "a"):
                        native.load = lambda lib=lib: libs[lib]  # type: ignore[assignment]
                        run()  # (the first call after a switch warms the other library)
                        t0 = time.perf_counter()
                        run()
                        seconds[lib].append(time.perf_counter() - t0)
                a, b = (statistics.median(seconds[n]) * 1e3 for n in ("a", "b"))
                results.append({"case": name, "a_median_ms": a, "b_median_ms": b,
                                "b_over_a": b / a})
                print(f"{name:34s} a {a:7.3f} ms  b {b:7.3f} ms  b/a {b / a:.3f}", flush=True)
    finally:
        native.load = load  # type: ignore[assignment]
    if ns.out:
        ns.out.write_text(json.dumps({"command": ns.command,
                                      "machine": machine_info(), "rounds": ns.rounds,
                                      "tiles": ns.tiles, "only": ns.only,
                                      "a": ns.a.name, "b": ns.b.name, "cases": results},
                                     indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
