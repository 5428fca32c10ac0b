"""Quantized linear kernels at SmolLM2-135M's shapes: Banyan's int8/int4 kernels
(kernels/cpu_quant_linear.cpp) beside torch's own weight-only ops (`_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu`) and the dense float32 / prepacked bf16 layers, interleaved in one
process (every variant once per round, ROUNDS rounds; the fastest round is kept, since on a
shared machine the slow rounds measure the other jobs), plus the machine's copy
bandwidth (a large tensor copy) that each variant's bytes are compared with.

    python benchmarks/quant_kernels.py [--rounds 15] [--out FILE]

Per shape and batch: milliseconds per call and, for batch 1, the achieved weight bytes per
second as a fraction of the copy bandwidth (a copy reads and writes, so bandwidth = 2 x bytes /
time of the copy).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from banyan.bench.offline import machine_info
from banyan.layers.linear import Linear, PackedBf16Method
from banyan.layers.quant import Int4Method, Int8Method

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}
BATCHES = (1, 64)
INT4_GROUP = 32


def copy_bandwidth(mib: int = 256, reps: int = 5) -> float:
    """Bytes per second of a large tensor copy (read + write counted)."""
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best


def torch_int4_variant(weight: torch.Tensor, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """torch's int4 op on the same grouped asymmetric quantization (bf16 scales and zeros:
    the op's dtype must match the activations)."""
    rows, cols = weight.shape
    grouped = weight.reshape(rows, cols // INT4_GROUP, INT4_GROUP)
    low, high = grouped.amin(-1), grouped.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-8)
    codes = torch.round((grouped - low[..., None]) / scale[..., None]).clamp(0, 15)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        codes.reshape(rows, cols).to(torch.int32), 1)
    # the op computes (code - 8) * scale + zero
    scales_zeros = torch.stack([scale, low + 8 * scale], -1).transpose(0, 1).contiguous()
    xb, sz = x.bfloat16(), scales_zeros.bfloat16()
    return lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, INT4_GROUP, sz)


def variants(weight: torch.Tensor, x: torch.Tensor) -> dict[str, tuple[Callable[[], object], int]]:
    """name -> (call, weight bytes it reads)."""
    rows, cols = weight.shape
    out: dict[str, tuple[Callable[[], object], int]] = {}
    dense = Linear.from_weight(weight.clone())
    out["dense_f32"] = (lambda: dense(x), rows * cols * 4)
    packed = Linear.from_weight(weight.bfloat16())
    if PackedBf16Method.available(torch.device("cpu"), torch.bfloat16):
        packed.convert(PackedBf16Method())
    xb = x.bfloat16()
    out["dense_bf16"] = (lambda: packed(xb), rows * cols * 2)
    int8 = Linear.from_weight(weight.clone())
    int8.convert(Int8Method())
    out["banyan_int8"] = (lambda: int8(x), int8.weight_bytes())
    codes = int8.method.dequantized_weight(int8) / int8.scale[:rows, None]
    codes = codes.round().to(torch.int8)
    scale = int8.scale[:rows].contiguous()
    out["torch_int8_f32act"] = (
        lambda: torch.ops.aten._weight_int8pack_mm(x, codes, scale), rows * (cols + 4))
    scale_b = scale.bfloat16()
    out["torch_int8_bf16act"] = (
        lambda: torch.ops.aten._weight_int8pack_mm(xb, codes, scale_b), rows * (cols + 2))
    int4 = Linear.from_weight(weight.clone())
    int4.convert(Int4Method(INT4_GROUP))
    out["banyan_int4"] = (lambda: int4(x), int4.weight_bytes())
    out["torch_int4_bf16act"] = (torch_int4_variant(weight, x),
                                 rows * (cols // 2 + 4 * cols // INT4_GROUP))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    results: dict[str, dict[str, dict[str, float]]] = {}
    with torch.inference_mode():
        for shape_name, (rows, cols) in SHAPES.items():
            weight = torch.randn(rows, cols) * 0.02
            for batch in BATCHES:
                x = torch.randn(batch, cols)
                calls = variants(weight, x)
                times: dict[str, list[float]] = {name: [] for name in calls}
                for _ in range(args.rounds):
                    for name, (call, _bytes) in calls.items():
                        call()  # warm: a cold cache would measure the first touch
                        t0 = time.perf_counter()
                        call()
                        times[name].append(time.perf_counter() - t0)
                key = f"{shape_name} {rows}x{cols} batch {batch}"
                results[key] = {}
                for name, (_call, nbytes) in calls.items():
                    ms = min(times[name]) * 1e3
                    row = {"ms": round(ms, 4),
                           "median_ms": round(statistics.median(times[name]) * 1e3, 4)}
                    if batch == 1:
                        row["fraction_of_copy_bandwidth"] = round(
                            nbytes / (ms / 1e3) / bandwidth, 3)
                    results[key][name] = row
                print(key, {n: r["ms"] for n, r in results[key].items()}, flush=True)
    report = {
        "command": "python " + " ".join(["benchmarks/quant_kernels.py", *sys.argv[1:]]),
        "machine": machine_info(),
        "note": "2-core machine shared with other engineers' jobs while measuring",
        "copy_bandwidth_gb_s": round(bandwidth / 1e9, 2),
        "int4_group": INT4_GROUP,
        "results": results,
    }
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text if not args.out else f"wrote {args.out}")


if __name__ == "__main__":
    main()
