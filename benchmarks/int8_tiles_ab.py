"""SmolLM2-135M's four projection shapes (q/k/v fused, o, gate/up fused, down) at a step's
token count, three ways in turns: bf16 weights in the GEMM's pairs (AMX tiles where the engine
would take them), weight-only int8 (dequantized to bf16 pairs, then the same products), and
`--activation-quant int8_tiles` (int8 x int8: AMX-INT8 tiles from 8 tokens, vpdpbusd below).
Each round times `--calls` passes of each, in the order reversed every round, for `--seconds`;
medians and each way's time over bf16's, round by round, are written. Every pass reads the same
four weights (8 MB in bf16, 4 in int8), where a model's step reads 30 layers' from memory.

    python benchmarks/int8_tiles_ab.py [--tokens 64] [--seconds 30] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from banyan.bench.offline import machine_info
from banyan.layers.gemm_tiles import gemm_tiles_route
from banyan.layers.int8_tiles import enable_int8_tiles, tiles_here
from banyan.layers.linear import Linear, SkinnyBf16Method
from banyan.layers.quant import Int8Method

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in)
WAYS = ("bf16", "int8 weight-only", "int8_tiles")


def layers_for(way: str) -> list[Linear]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for n, k in SHAPES:
        layer = Linear.from_weight((torch.randn(n, k, generator=gen) * 0.05).bfloat16())
        layer.convert(SkinnyBf16Method() if way == "bf16" else Int8Method())
        if way == "int8_tiles":
            enable_int8_tiles(layer)
        out.append(layer)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--calls", type=int, default=30, help="passes a way takes per round")
    ap.add_argument("--out", type=Path, default=None)
    ns = ap.parse_args()
    mode = gemm_tiles_route(torch.bfloat16)  # as an engine sets it: 2 = AMX tiles for bf16
    ways = {w: layers_for(w) for w in WAYS}
    xs = [torch.randn(ns.tokens, k).bfloat16() for _, k in SHAPES]
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    end, order = time.perf_counter() + ns.seconds, list(WAYS)
    with torch.inference_mode():
        while time.perf_counter() < end:
            for way in order:
                t0 = time.perf_counter()
                for _ in range(ns.calls):
                    for layer, x in zip(ways[way], xs):
                        layer(x)
                times[way].append((time.perf_counter() - t0) / ns.calls)
            order.reverse()
    result: dict[str, Any] = {
        "command": "python " + " ".join(sys.argv), "machine": machine_info(),
        "tokens": ns.tokens, "rounds": len(times["bf16"]), "bf16_gemm_tiles_mode": mode,
        "int8_tiles_here": tiles_here(),
        "median_ms": {w: 1e3 * statistics.median(t) for w, t in times.items()},
        "over_bf16_round_by_round": {
            w: statistics.median(a / b for a, b in zip(t, times["bf16"]))
            for w, t in times.items()}}
    print(json.dumps(result, indent=1))
    if ns.out:
        ns.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
