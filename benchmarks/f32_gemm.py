"""float32 GEMMs at SmolLM2-135M's shapes: F.linear (MKL's sgemm in torch's CPU build) beside
oneDNN on the same plain weight (`banyan.layers.f32_linear.onednn_linear`), for decode-sized
and prefill-sized steps; the choice `SkinnyF32Method` makes per shape rests on the same comparison.
Beside them, the bf16 path's GEMM (oneDNN on a weight packed once, `PackedBf16Method`), to see
which dtype computes faster on this CPU.

    python benchmarks/f32_gemm.py [--rounds 5] [--out FILE]

Each (shape, rows) is timed alternately, min over rounds in ms, with GFLOP/s and the largest
difference from F.linear relative to its largest output.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from banyan.bench.offline import machine_info
from banyan.layers.f32_linear import onednn_linear

# fused qkv, o, fused gate-up, down, the tied LM head
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
ROWS = [1, 8, 32, 64, 128, 512, 2048]


def best_ms(fn: Callable[[], object], rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows_out = []
    with torch.inference_mode():
        for rows in ROWS:
            for out_f, in_f in SHAPES:
                if out_f * in_f * rows > 2**33:
                    continue  # the head at prefill sizes: seconds a call, and never asked
                gen = torch.Generator().manual_seed(out_f + rows)
                w = torch.randn(out_f, in_f, generator=gen)
                x = torch.randn(rows, in_f, generator=gen)
                mkl = best_ms(lambda: torch.nn.functional.linear(x, w), args.rounds)
                dnn = best_ms(lambda: onednn_linear(x, w, None), args.rounds)
                packed = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), None)
                xb = x.bfloat16()
                bf16 = best_ms(lambda: torch.ops.mkldnn._linear_pointwise(
                    xb, packed, None, "none", [], ""), args.rounds)
                want = torch.nn.functional.linear(x, w)
                err = float((onednn_linear(x, w, None) - want).abs().max() / want.abs().max())
                gflop = 2 * rows * out_f * in_f / 1e9
                row = {"shape": [out_f, in_f], "rows": rows, "f_linear_ms": mkl,
                       "onednn_ms": dnn, "onednn_speedup": mkl / dnn,
                       "f_linear_gflops": gflop / mkl * 1e3, "onednn_gflops": gflop / dnn * 1e3,
                       "packed_bf16_ms": bf16, "packed_bf16_gflops": gflop / bf16 * 1e3,
                       "max_rel_diff": err}
                rows_out.append(row)
                print(f"{rows:5d} rows {out_f:5d}x{in_f}: F.linear {mkl:8.2f} ms, oneDNN "
                      f"{dnn:8.2f} ms ({mkl / dnn:.2f}x), diff {err:.0e}; packed bf16 "
                      f"{bf16:8.2f} ms ({gflop / bf16 * 1e3:.0f} GFLOP/s)", flush=True)
    report = {"command": " ".join(["python"] + sys.argv), "machine": machine_info(),
              "threads": torch.get_num_threads(), "results": rows_out}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
