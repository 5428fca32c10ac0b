"""A bf16 LM head of SmolLM2-135M's shape (49,152 x 576), oneDNN's packed GEMM against the bf16
GEMM kernel on the weight in pairs (PairsBf16Method, what a bf16 model with the native layer
stack uses), at the step sizes a head sees: 1 (batch-1 decode), 8-16 (speculative checks,
small batches), 32-128 (batched decodes). Calls alternate, medians over --rounds.

    python benchmarks/bf16_head.py [--rounds 60] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from banyan.bench.offline import command_line, machine_info
from banyan.kernels import native
from banyan.layers.linear import Linear, PackedBf16Method, PairsBf16Method

VOCAB, HIDDEN = 49152, 576
TOKENS = (1, 8, 16, 32, 64, 128)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--out", type=Path, default=None)
    ns = ap.parse_args()
    if not native.bf16_gemm_here():
        print("the bf16 GEMM kernel needs AVX512-BF16", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    weight = (torch.randn(VOCAB, HIDDEN) * 0.05).bfloat16()
    heads = {"onednn_packed": PackedBf16Method(), "pairs": PairsBf16Method()}
    layers = {}
    for name, method in heads.items():
        layers[name] = Linear.from_weight(weight.clone())
        layers[name].convert(method)
    rows = []
    with torch.inference_mode():
        for tokens in TOKENS:
            x = torch.randn(tokens, HIDDEN).bfloat16()
            seconds: dict[str, list[float]] = {name: [] for name in layers}
            for _ in range(ns.rounds):
                for name, layer in layers.items():
                    t0 = time.perf_counter()
                    layer(x)
                    seconds[name].append(time.perf_counter() - t0)
            row = {"tokens": tokens, **{f"{n}_ms": statistics.median(s) * 1e3
                                        for n, s in seconds.items()}}
            row["pairs_over_onednn"] = row["pairs_ms"] / row["onednn_packed_ms"]
            rows.append(row)
            print(f"{tokens:4d} tokens: oneDNN packed {row['onednn_packed_ms']:.3f} ms, pairs "
                  f"{row['pairs_ms']:.3f} ms ({row['pairs_over_onednn']:.3f}x)", flush=True)
    if ns.out:
        ns.out.write_text(json.dumps({"command": command_line(),
                                      "machine": machine_info(), "rounds": ns.rounds,
                                      "shape": [VOCAB, HIDDEN], "cases": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
