"""Two builds of the bf16 GEMM kernel (banyan_quant_gemm_bf16, kernels/cpu_quant_gemm_bf16.cpp)
against each other in one process, call by call, on SmolLM2-135M's layer shapes: int4 (group
32), int8 (a scale per row) and dense bf16 pairs, every call of one build followed by the same
call of the other (their order swapped every round), so a drift of the machine's speed hits
both alike. The two builds' outputs are checked to be the same bits first (--new-bits METHOD:
that method's may differ, as for a change of what it computes; their largest difference is
printed, relative to the largest output).

Build the other checkout's kernels (any Banyan call that loads them writes the library into the
kernel cache, ~/.cache/banyan/kernels, named by a hash of their sources), then:

    python benchmarks/bf16_gemm_ab.py A.so B.so [--tokens 64] [--rounds 150] [--out FILE] \
        [--new-bits int8] [--tiles]

--tiles: both builds' steps on AMX tiles (cpu_quant_gemm_tiles.h; a CPU with AMX, and --tokens
over 16).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from typing import Any

import torch

from banyan.bench.offline import machine_info
from banyan.layers.linear import Linear, SkinnyBf16Method
from banyan.layers.quant import BF16_GEMM_KINDS, Int4Method, Int8Method
from two_builds import gemm_libraries, outputs_apart, parse_args  # (this script's folder)

SHAPES = {"gate_up": (3072, 576), "down": (576, 1536), "qkv": (960, 576)}  # (out, in)
BF16_PAIRS_KIND = 5  # kBf16Pairs


def call_args(method: str, n: int, k: int, tokens: int,
              keep: list[Any]) -> tuple[Any, ...]:
    """banyan_quant_gemm_bf16's arguments for a random layer in `method` (its tensors kept
    alive in `keep`)."""
    w = torch.randn(n, k) * 0.05
    layer = Linear.from_weight(w.bfloat16() if method == "bf16" else w)
    layer.convert({"bf16": SkinnyBf16Method, "int4": lambda: Int4Method(32),
                   "int8": Int8Method}[method]())
    spec = layer.method.native(layer)
    assert spec is not None
    kind = BF16_PAIRS_KIND if method == "bf16" else BF16_GEMM_KINDS[spec.kind]
    x = torch.randn(tokens, k).bfloat16()
    out = torch.empty(tokens, n, dtype=torch.bfloat16)
    keep += [layer, spec, x, out]
    return (x.data_ptr(), tokens, k, kind, spec.weight.data_ptr(), _ptr(spec.scale),
            _ptr(spec.mins), spec.group, None, out.data_ptr(), n, torch.get_num_threads())


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def main() -> int:
    def more(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--new-bits", default="",
                        help="a method whose outputs may differ between the builds")
        ap.add_argument("--tiles", action="store_true",
                        help="both builds' GEMM on AMX tiles (a CPU with AMX; steps > 16 tokens)")

    ns = parse_args(__doc__, "64", 150, more)
    if len(ns.tokens) != 1:
        raise SystemExit("--tokens: one count here")
    ns.tokens = ns.tokens[0]
    libs = gemm_libraries(ns.a, ns.b, ns.tiles)
    torch.manual_seed(0)
    keep: list[Any] = []
    cases = {(shape, method): call_args(method, n, k, ns.tokens, keep)
             for shape, (n, k) in SHAPES.items() for method in ("int4", "int8", "bf16")}
    differences: dict[str, float] = {}
    for case, args in cases.items():  # the same bits from both
        got = []
        for lib in libs.values():
            lib.banyan_quant_gemm_bf16(*args)
            got.append(torch.frombuffer(bytearray(ctypes.string_at(  # out, bf16
                args[9], ns.tokens * args[10] * 2)), dtype=torch.bfloat16))
        if not outputs_apart(" ".join(case), *got, case[1] == ns.new_bits, differences):
            return 1
    seconds: dict[tuple[str, str, str], list[float]] = {
        (*case, name): [] for case in cases for name in libs}
    for r in range(ns.rounds):
        for case, args in cases.items():
            order = list(libs.items())
            for name, lib in order if r % 2 else order[::-1]:
                t0 = time.perf_counter()
                lib.banyan_quant_gemm_bf16(*args)
                seconds[(*case, name)].append(time.perf_counter() - t0)
    rows = []
    for shape, method in cases:
        a, b = (seconds[(shape, method, name)] for name in libs)
        row = {"shape": shape, "method": method,
               "a_median_ms": statistics.median(a) * 1e3, "b_median_ms": statistics.median(b) * 1e3,
               "a_best_ms": min(a) * 1e3, "b_best_ms": min(b) * 1e3}
        row["b_over_a_median"] = row["b_median_ms"] / row["a_median_ms"]
        row["b_over_a_best"] = row["b_best_ms"] / row["a_best_ms"]
        rows.append(row)
        print(f"{shape:8s} {method:5s} median a {row['a_median_ms']:.3f} b "
              f"{row['b_median_ms']:.3f} ms (b/a {row['b_over_a_median']:.3f}), best b/a "
              f"{row['b_over_a_best']:.3f}", flush=True)
    if ns.out:
        result = {"command": ns.command, "machine": machine_info(),
                  "tokens": ns.tokens, "rounds": ns.rounds, "a": ns.a.name, "b": ns.b.name,
                  "new_bits": ns.new_bits, "tiles": ns.tiles,
                  "largest_differences": differences, "cases": rows}
        ns.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
