"""Gated activation of the Llama MLP on a fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from banyan.kernels import fused_ops


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up: [T, 2*I] (gate rows first, then up, as fused by the loader) -> [T, I]
    fused = fused_ops.silu_and_mul(gate_up)  # one pass on CPU, the same values
    if fused is not None:
        return fused
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
