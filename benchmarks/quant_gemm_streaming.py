"""Quantized linears of a whole SmolLM2-135M (30 layers x qkv, o, gate/up, down) in a bf16
model, one pass over all 120 of them per step, T tokens each: the weights (84 MB of int4 codes,
135 MB of int8, 212 MB of bf16) stream from DRAM as in a real batched step, which the one-layer
kernel timings (quant_kernels.py) keep in cache. `bf16`: the dense layers as a bf16 engine
converts them (SkinnyBf16Method where the CPU has vdpbf16ps, else oneDNN's packed GEMM). Run
it from two checkouts, alternating, to compare kernels:

    PYTHONPATH=<checkout> python benchmarks/quant_gemm_streaming.py [--tokens 16,64]
        [--methods int4,int4-widened,int8,int8-widened,q8_0,q8_0-widened,bf16] [--rounds 15]
        [--out FILE]

Per method and token count: the fastest (and the median) of --rounds passes, in ms, the methods
timed in turns.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from banyan.bench.offline import command_line, machine_info
from banyan.layers.linear import Linear, LinearMethod, PackedBf16Method, SkinnyBf16Method
from banyan.layers.gguf_linear import GroupInt8Method
from banyan.layers.quant import Int4Method, Int8Method

LAYERS = 30
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o, gate/up, down


def dense_bf16() -> LinearMethod:
    cpu = torch.device("cpu")
    return (SkinnyBf16Method() if SkinnyBf16Method.available(cpu, torch.bfloat16) and
            SkinnyBf16Method.suits_here() else PackedBf16Method())


def widened(method: type[LinearMethod]) -> type[LinearMethod]:
    """`method` as before its bf16 kernel (cpu_int4_bf16_linear.cpp, cpu_int8_bf16_linear.cpp):
    a short bf16 step through the float32 kernel on x widened (the same values but for
    roundings), to compare the two in one run."""

    class Widened(method):  # type: ignore[misc, valid-type]
        def _bf16_short(self, layer: Linear, x: torch.Tensor) -> torch.Tensor | None:
            return None

    return Widened


def q8_0(method: type[LinearMethod]) -> Callable[[Linear], LinearMethod]:
    """GGUF's Q8_0 (int8 codes, a float32 scale per 32 inputs) made from the layer's weight,
    computed by `method` (GroupInt8Method or its widened twin)."""

    def make(layer: Linear) -> LinearMethod:
        w = layer.weight.float().view(layer.out_features, -1, 32)
        scale = w.abs().amax(-1).clamp_min(1e-8) / 127
        codes = torch.round(w / scale[..., None]).to(torch.int8).view(layer.out_features, -1)
        return method(codes, scale, 32)

    return make


INT4_WIDENED, INT8_WIDENED = widened(Int4Method), widened(Int8Method)
METHODS: dict[str, Callable[[Linear], LinearMethod]] = {
    "int4": lambda _: Int4Method(32), "int4-widened": lambda _: INT4_WIDENED(32),
    "int8": lambda _: Int8Method(), "int8-widened": lambda _: INT8_WIDENED(),
    "q8_0": q8_0(GroupInt8Method), "q8_0-widened": q8_0(widened(GroupInt8Method)),
    "bf16": lambda _: dense_bf16()}


def model_linears(method: str) -> list[Linear]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(LAYERS):
        for n, k in SHAPES:
            weight = torch.randn(n, k, generator=gen) * 0.05
            layer = Linear.from_weight(weight.bfloat16() if method == "bf16" else weight)
            layer.convert(METHODS[method](layer))
            out.append(layer)
    return out


def passes(layers: list[Linear], tokens: int) -> Callable[[], None]:
    xs = [torch.randn(tokens, layer.in_features).bfloat16() for layer in layers]

    def one_pass() -> None:
        for layer, x in zip(layers, xs):
            layer(x)

    return one_pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="16,64")
    parser.add_argument("--methods", default="int4,int8")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    methods = args.methods.split(",")
    models = {method: model_linears(method) for method in methods}
    results: dict[str, float] = {}
    medians: dict[str, float] = {}
    for tokens in map(int, args.tokens.split(",")):
        runs = {method: passes(models[method], tokens) for method in methods}
        for run in runs.values():
            run()  # (the first call builds the kernels)
        times: dict[str, list[float]] = {method: [] for method in methods}
        for _ in range(args.rounds):  # the methods in turns: a drift of the VM hits all alike
            for method, run in runs.items():
                t0 = time.perf_counter()
                run()
                times[method].append((time.perf_counter() - t0) * 1e3)
        for method in methods:
            key = f"{method} {tokens} tokens"
            results[key], medians[key] = min(times[method]), statistics.median(times[method])
            print(f"{method:12s} {tokens:4d} tokens  {results[key]:7.2f} ms a pass of "
                  f"{len(models[method])} linears (median {medians[key]:.2f})")
    if args.out:
        args.out.write_text(json.dumps({"command": command_line(), "machine": machine_info(),
                                        "ms": results, "ms_median": medians}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
