"""Two builds of the bf16 GEMM kernel on a whole forward's projections, as a bf16 model's decode,
speculative check or batched step runs them: SmolLM2-135M's 30 x 4 weights (212 MB in the pairs
layout of a dense bf16 layer; --method int8 or int4: quantized, as bf16_gemm_ab.py makes them)
one after the other, T tokens each, so the weights stream from memory as in the engine
(bf16_gemm_ab.py times one layer at a time, in cache). The two builds alternate forward by
forward (order swapped every round), after a check that they give the same bits (--new-bits:
the method's may differ; their largest difference is printed).

    python benchmarks/bf16_pairs_forward_ab.py A.so B.so [--tokens 1,8,9,12,13,16] [--rounds 9]
        [--method bf16] [--new-bits] [--tiles] [--out FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time

import torch

from banyan.bench.offline import machine_info
from bf16_gemm_ab import call_args  # (this script's folder)
from two_builds import gemm_libraries, outputs_apart, parse_args

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate/up, down (out, in)
LAYERS = 30


def more_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--method", default="bf16", choices=["bf16", "int8", "int4"])
    ap.add_argument("--new-bits", action="store_true",
                    help="the builds' outputs may differ (a change of what the method computes)")
    ap.add_argument("--tiles", action="store_true",
                    help="both builds' GEMM on AMX tiles, as the engine runs it on a CPU with AMX "
                         "(dense pairs at every step, quantized weights from 17 tokens)")


def main() -> int:
    ns = parse_args(__doc__, "1,8,9,12,13,16", 9, more_args)
    libs = gemm_libraries(ns.a, ns.b, ns.tiles)
    torch.manual_seed(0)
    tokens, keep = ns.tokens, []
    # every layer's call per token count (its own input and output), the weights shared
    layers = [call_args(ns.method, n, k, tokens[0], keep) for _ in range(LAYERS)
              for n, k in SHAPES]
    weight_bytes = sum(n * k for _ in range(LAYERS) for n, k in SHAPES) * (
        {"bf16": 2, "int8": 1, "int4": 0.5}[ns.method])
    calls = {t: [] for t in tokens}
    for t in tokens:
        xs = {k: torch.randn(t, k).bfloat16() for k in (576, 1536)}
        out = torch.empty(t, max(n for n, _ in SHAPES), dtype=torch.bfloat16)
        keep += [xs, out]
        for args in layers:  # (x, T, K, kind, weight, scale, mins, group, bias, out, N, threads)
            k = args[2]
            calls[t].append((xs[k].data_ptr(), t, *args[2:9], out.data_ptr(), *args[10:]))
        calls[t].append(out)  # the last projection's output, for the check

    def forward(lib: ctypes.CDLL, t: int) -> None:
        for args in calls[t][:-1]:
            lib.banyan_quant_gemm_bf16(*args)

    differences: dict[str, float] = {}
    for t in tokens:  # the same bits from both (the last projection's output)
        got = []
        for lib in libs.values():
            forward(lib, t)
            got.append(calls[t][-1].clone())
        if not outputs_apart(f"{t} tokens", *got, ns.new_bits, differences):
            return 1
    seconds: dict[tuple[int, str], list[float]] = {(t, n): [] for t in tokens for n in libs}
    for r in range(ns.rounds):
        for t in tokens:
            order = list(libs.items())
            for name, lib in order if r % 2 else order[::-1]:
                t0 = time.perf_counter()
                forward(lib, t)
                seconds[(t, name)].append(time.perf_counter() - t0)
    rows = []
    for t in tokens:
        a, b = (statistics.median(seconds[(t, n)]) for n in libs)
        rows.append({"tokens": t, "a_median_ms": a * 1e3, "b_median_ms": b * 1e3,
                     "b_over_a": b / a, "a_weight_gb_s": weight_bytes / a / 1e9})
        print(f"T={t:3d} a {a * 1e3:7.2f} ms b {b * 1e3:7.2f} ms  b/a {b / a:.3f}  "
              f"(a streams {weight_bytes / a / 1e9:.1f} GB/s)", flush=True)
    if ns.out:
        result = {"command": ns.command, "machine": machine_info(), "method": ns.method,
                  "rounds": ns.rounds, "a": ns.a.name, "b": ns.b.name, "tiles": ns.tiles,
                  "largest_differences": differences, "cases": rows}
        ns.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
