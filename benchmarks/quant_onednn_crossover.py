"""Where a quantized layer's long steps should leave the bf16 GEMM kernel for oneDNN: each of
SmolLM2-135M's layer shapes as int4 (group 32) and int8, at several token counts, through both
of `layers/quant.py`'s batched paths in one process (the kernel, banyan_quant_gemm_bf16; and the
weight dequantized to plain bf16, then torch's GEMM), medians of alternating calls. The switch is
`ONEDNN_MIN_TOKENS` (AMX CPUs only; elsewhere the kernel takes every step); this prints each
case's kernel / oneDNN time ratio. --tiles 2 (AMX CPUs; 1: tiles emulated, a check only) adds
the kernel with its products on tiles (layers/gemm_tiles.py) as a third path.

    python benchmarks/quant_onednn_crossover.py [--tokens 512,1024,2048] [--rounds 15]
        [--tiles 2] [--out F]
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
from banyan.layers import quant
from banyan.layers.gemm_tiles import set_gemm_tiles
from banyan.layers.linear import Linear
from banyan.layers.quant import Int4Method, Int8Method

SHAPES = {"gate_up": (3072, 576), "down": (576, 1536), "qkv": (960, 576)}  # (out, in)
# (ONEDNN_MIN_TOKENS that sends every step one way, the kernel's tile mode)
PATHS = {"onednn": (1, 0), "kernel": (None, 0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="512,1024,2048")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--tiles", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    ns = ap.parse_args()
    paths = dict(PATHS)
    if ns.tiles:
        if set_gemm_tiles(ns.tiles) != ns.tiles:
            ap.error(f"tile mode {ns.tiles} refused here (2 needs AMX)")
        paths["tiles"] = (None, ns.tiles)
    torch.manual_seed(0)
    kept, kept_tiles = quant.ONEDNN_MIN_TOKENS, set_gemm_tiles(0)
    rows = []
    with torch.inference_mode():
        for method, make in (("int4", lambda: Int4Method(32)), ("int8", Int8Method)):
            for shape, (n, k) in SHAPES.items():
                layer = Linear.from_weight(torch.randn(n, k) * 0.05)
                layer.convert(make())
                for tokens in (int(t) for t in ns.tokens.split(",")):
                    x = torch.randn(tokens, k).bfloat16()
                    ms: dict[str, list[float]] = {path: [] for path in paths}
                    for r in range(ns.rounds + 1):  # (round 0: warm-up, not kept)
                        for path in paths if r % 2 else reversed(paths):
                            quant.ONEDNN_MIN_TOKENS, mode = paths[path]
                            set_gemm_tiles(mode)
                            t0 = time.perf_counter()
                            layer(x)
                            if r:
                                ms[path].append((time.perf_counter() - t0) * 1e3)
                    med = {path: statistics.median(v) for path, v in ms.items()}
                    row = {"method": method, "shape": shape, "tokens": tokens,
                           "kernel_ms": med["kernel"], "onednn_ms": med["onednn"],
                           "kernel_over_onednn": med["kernel"] / med["onednn"]}
                    tiles = ""
                    if "tiles" in med:
                        row["tiles_ms"] = med["tiles"]
                        row["tiles_over_onednn"] = med["tiles"] / med["onednn"]
                        tiles = f", on tiles {med['tiles']:.3f} ms ({row['tiles_over_onednn']:.3f})"
                    rows.append(row)
                    print(f"{method} {shape:8s} {tokens:5d} tokens: kernel {med['kernel']:.3f} "
                          f"ms, oneDNN {med['onednn']:.3f} ms ({row['kernel_over_onednn']:.3f})"
                          + tiles, flush=True)
    quant.ONEDNN_MIN_TOKENS = kept
    set_gemm_tiles(kept_tiles)
    if ns.out:
        ns.out.write_text(json.dumps({
            "command": command_line(),
            "machine": machine_info(), "threads": torch.get_num_threads(),
            "onednn_min_tokens": kept, "tiles": ns.tiles, "rounds": ns.rounds,
            "results": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
