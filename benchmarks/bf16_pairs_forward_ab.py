"""Two builds of the bf16 GEMM kernel on a whole forward's projections, as a bf16 model's decode
or speculative check runs them: SmolLM2-135M's 30 x 4 weights (212 MB, in the pairs layout of a
dense bf16 layer) one after the other, T tokens each, so the weights stream from memory as in
the engine (bf16_gemm_ab.py times one layer at a time, in cache). The two builds alternate
forward by forward (order swapped every round), after a check that they give the same bits.

    python benchmarks/bf16_pairs_forward_ab.py A.so B.so [--tokens 1,8,9,12,13,16] [--rounds 9]
        [--out FILE]
"""

from __future__ import annotations

import ctypes
import json
import statistics
import sys
import time

import torch

from banyan.bench.offline import machine_info
from banyan.layers.panels import pack_bf16_pairs
from two_builds import gemm_libraries, parse_args  # (this script's folder)

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate/up, down (out, in)
LAYERS = 30
PAIRS_KIND = 5  # kBf16Pairs


def main() -> int:
    ns = parse_args(__doc__, "1,8,9,12,13,16", 9)
    libs = gemm_libraries(ns.a, ns.b)
    torch.manual_seed(0)
    weights = [(pack_bf16_pairs(torch.randn(n, k).bfloat16() * 0.02), n, k)
               for _ in range(LAYERS) for n, k in SHAPES]
    weight_bytes = sum(n * k * 2 for _, n, k in weights)
    tokens = ns.tokens
    xs = {t: {k: torch.randn(t, k).bfloat16() for k in (576, 1536)} for t in tokens}
    outs = {t: torch.empty(t, max(n for n, _ in SHAPES), dtype=torch.bfloat16) for t in tokens}
    threads = torch.get_num_threads()

    def forward(lib: ctypes.CDLL, t: int) -> None:
        for w, n, k in weights:
            lib.banyan_quant_gemm_bf16(xs[t][k].data_ptr(), t, k, PAIRS_KIND, w.data_ptr(), None,
                                       None, 0, None, outs[t].data_ptr(), n, threads)

    for t in tokens:  # the same bits from both (the last projection's output)
        got = []
        for lib in libs.values():
            forward(lib, t)
            got.append(outs[t].clone())
        if not torch.equal(got[0], got[1]):
            print(f"{t} tokens: the two builds' outputs differ", file=sys.stderr)
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
        result = {"command": ns.command, "machine": machine_info(),
                  "rounds": ns.rounds, "a": ns.a.name, "b": ns.b.name, "cases": rows}
        ns.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
