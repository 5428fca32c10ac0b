"""The native linear kernels' panel layout: rows padded to a multiple of PANEL and cut into
panels of PANEL rows; in a panel the rows' values for one input (or one pair of inputs) sit side
by side, so one vector load gives the same input of PANEL output rows (kernels/
cpu_quant_common.h). The quantized methods (quant.py, gguf_linear.py, int8_activations.py) pack
their codes and scales this way, and a dense bf16 layer its weight's pairs (linear.py)."""

from __future__ import annotations

import torch

PANEL = 16


def pad_rows(weight: torch.Tensor) -> torch.Tensor:
    """[rows, ...] -> [rows rounded up to PANEL, ...], the new rows zero."""
    rows = weight.shape[0]
    padded = -(-rows // PANEL) * PANEL
    if padded == rows:
        return weight
    return torch.cat([weight, weight.new_zeros(padded - rows, weight.shape[1])])


def to_panels(per_row: torch.Tensor) -> torch.Tensor:
    """[rows (padded), ...cols] -> [panels, ...cols, 16]: a panel's rows side by side."""
    panels = per_row.shape[0] // PANEL
    shaped = per_row.reshape(panels, PANEL, *per_row.shape[1:])
    return shaped.movedim(1, -1).contiguous()


def from_panels(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """to_panels undone -> [rows, ...cols] (the padding rows dropped)."""
    return packed.movedim(-1, 1).reshape(-1, *packed.shape[1:-1])[:rows]


def unpack_bf16_pairs(pairs: torch.Tensor, rows: int) -> torch.Tensor:
    """pack_bf16_pairs undone -> the bf16 weight [rows, K]."""
    return from_panels(pairs, rows).contiguous().view(torch.bfloat16)


def pack_bf16_pairs(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 [N, K] weight (K even) in the panels the bf16 GEMM's vdpbf16ps reads (kBf16Pairs):
    lane i of word j = row i's inputs 2j, 2j + 1 -> int32 [ceil(N / 16), K / 2, 16], a fresh
    tensor (torch's CPU allocator aligns it to 64 bytes, as the kernel's aligned loads need)."""
    return to_panels(pad_rows(weight.detach().contiguous().view(torch.int32)))
