"""Quantized linears of a whole SmolLM2-135M (30 layers x qkv, o, gate/up, down) in a bf16
model, one pass over all 120 of them per step, T tokens each: the weights (84 MB of int4 codes,
135 MB of int8, 212 MB of bf16) stream from DRAM as in a real batched step, which the one-layer
kernel timings (quant_kernels.py) keep in cache. `bf16`: the dense layers as a bf16 engine
converts them (SkinnyBf16Method where the CPU has vdpbf16ps, else oneDNN's packed GEMM). Run
it from two checkouts, alternating, to compare kernels:

    PYTHONPATH=<checkout> python benchmarks/quant_gemm_streaming.py [--tokens 16,64]
        [--methods int4,int4-widened,int8,bf16] [--rounds 15] [--out FILE]

Per method and token count: the fastest of --rounds passes, in ms.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from banyan.bench.offline import command_line, machine_info
from banyan.layers.linear import Linear, LinearMethod, PackedBf16Method, SkinnyBf16Method
from banyan.layers.quant import Int4Method, Int8Method
from f32_gemm import best_ms  # (this script's folder)

LAYERS = 30
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o, gate/up, down


def dense_bf16() -> LinearMethod:
    cpu = torch.device("cpu")
    return (SkinnyBf16Method() if SkinnyBf16Method.available(cpu, torch.bfloat16) and
            SkinnyBf16Method.suits_here() else PackedBf16Method())


class Int4WidenedMethod(Int4Method):
    """int4 as before cpu_int4_bf16_linear.cpp: a short bf16 step through the float32 kernel on
    x widened (the same values but for roundings), to compare the two in one run."""

    def _bf16_short(self, layer: Linear, x: torch.Tensor) -> torch.Tensor | None:
        return None


METHODS = {"int4": lambda: Int4Method(32), "int4-widened": lambda: Int4WidenedMethod(32),
           "int8": Int8Method, "bf16": dense_bf16}


def model_linears(method: str) -> list[Linear]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(LAYERS):
        for n, k in SHAPES:
            weight = torch.randn(n, k, generator=gen) * 0.05
            layer = Linear.from_weight(weight.bfloat16() if method == "bf16" else weight)
            layer.convert(METHODS[method]())
            out.append(layer)
    return out


def best_pass_ms(layers: list[Linear], tokens: int, rounds: int) -> float:
    xs = [torch.randn(tokens, layer.in_features).bfloat16() for layer in layers]

    def one_pass() -> None:
        for layer, x in zip(layers, xs):
            layer(x)

    return best_ms(one_pass, rounds)  # (its first call builds the kernels)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="16,64")
    parser.add_argument("--methods", default="int4,int8")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results: dict[str, float] = {}
    for method in args.methods.split(","):
        layers = model_linears(method)
        for tokens in map(int, args.tokens.split(",")):
            results[f"{method} {tokens} tokens"] = ms = best_pass_ms(layers, tokens, args.rounds)
            print(f"{method:12s} {tokens:4d} tokens  {ms:7.2f} ms a pass of {len(layers)} linears")
    if args.out:
        args.out.write_text(json.dumps({"command": command_line(),
                                        "machine": machine_info(), "ms": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
