"""AMX's tiles against their emulation, bit for bit, for each kernel that runs on tiles (a
diagnostic for the first AMX session; nothing is timed).

The emulated tiles (kernels/cpu_amx_tiles.h: SoftTiles) sum as the SDM's pseudocode defines
tdpbf16ps, so where the silicon does what the manual says, every kernel's output on AMX's tiles
(mode 2) has the bits of the same call on the emulated ones (mode 1). The library's start-up
check (cpu_amx_check.cpp) compares one block of small integers, whose sums are exact in any
order; this compares the kernels' own outputs on random inputs, where the order shows:

- the quantized bf16 GEMM (int4 and int8 layers of SmolLM2's gate/up shape, 64 and 300 tokens),
- the row kernel: lone decodes, a decode group over a shared prefix, a speculative check,
- the prefill kernel: a fresh 1,000-token prefill.

Inputs with magnitudes over a wide range, so that a sum's order shows in its rounded (bf16)
output. Each line gives the share of output elements whose bits match and the largest
difference. 100% everywhere: the emulation, which every test on CPUs without AMX runs, is the
hardware's behaviour. Less: the silicon's order differs from the pseudocode's (the tests still
hold; they ask tile bits only of tile bits), worth recording with the share. `--emulated`
compares the emulated tiles with the vector paths instead (any CPU with the tile paths built):
how far each case can tell two orders apart at all.

    python benchmarks/amx_tile_bits.py [--emulated] [--out benchmarks/results/FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from banyan.attention.decode_tiles import DecodeProbe, outputs_in_mode, tiles_mode
from banyan.attention.prefill_choice import _Probe, amx_refusal
from banyan.bench.offline import command_line, machine_info
from banyan.kernels import native
from banyan.layers.gemm_tiles import _probe_layers, set_gemm_tiles
from banyan.layers.linear import Linear


def heavy(t: torch.Tensor, seed: int) -> torch.Tensor:
    """t's elements times e^(2 N(0, 1)): magnitudes over a wide range, so that the order of a
    sum shows in its rounded result more often than on plain normal inputs."""
    gen = torch.Generator().manual_seed(seed)
    return (t.float() * torch.exp(2 * torch.randn(t.shape, generator=gen))).to(t.dtype)


def gemm_case(layer: Linear, tokens: int) -> Callable[[int], torch.Tensor]:
    x = heavy(torch.randn(tokens, layer.in_features), tokens).bfloat16()

    def run(mode: int) -> torch.Tensor:
        with tiles_mode(mode, set_gemm_tiles), torch.inference_mode():
            return layer(x)
    return run


def cases() -> dict[str, Callable[[int], torch.Tensor]]:
    int4, int8 = _probe_layers()
    out = {f"quantized GEMM, {name}, {t} tokens": gemm_case(layer, t)
           for name, layer in (("int4", int4), ("int8", int8)) for t in (64, 300)}
    for name, probe in (("decodes alone", DecodeProbe.make(3, 64, 16, 0, 200)),
                        ("a decode group (8 over 1,024 shared keys)",
                         DecodeProbe.make(3, 64, 8, 1024, 100)),
                        ("a 13-token check", DecodeProbe.make(3, 64, 4, 0, 300, check=13))):
        probe.k.copy_(heavy(probe.k, 1)), probe.v.copy_(heavy(probe.v, 2))
        out[f"row kernel, {name}"] = lambda mode, probe=probe: outputs_in_mode(probe, mode)
    prefill = _Probe.make(3, 64, torch.bfloat16, 1000, 3)
    prefill.k.copy_(heavy(prefill.k, 1)), prefill.v.copy_(heavy(prefill.v, 2))
    out["prefill kernel, a fresh 1,000-token prefill"] = prefill.kernel
    return out


def compare(want: torch.Tensor, got: torch.Tensor) -> dict[str, float]:
    same = (want.view(torch.int16) == got.view(torch.int16)).float().mean().item()
    return {"bits_equal_share": same,
            "max_abs_difference": (want.float() - got.float()).abs().max().item()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--emulated", action="store_true",
                    help="compare the emulated tiles with the vector paths (any CPU with the "
                    "tile paths built): how often each case's bits can show an order at all")
    args = ap.parse_args()
    modes = (0, 1) if args.emulated else (1, 2)
    if max(modes) > native.prefill_tiles():
        sys.exit(f"AMX's tiles do not run here: {amx_refusal()}")
    rows = {}
    for name, run in cases().items():
        rows[name] = compare(run(modes[0]), run(modes[1]))
        print(f"{name}: {100 * rows[name]['bits_equal_share']:.3f}% of the elements' bits equal "
              f"(modes {modes}), largest difference {rows[name]['max_abs_difference']:.3g}")
    result = {"command": command_line(), "machine": machine_info(), "modes": modes,
              "cases": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
