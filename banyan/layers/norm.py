"""RMSNorm, computed in float32 like the Hugging Face reference whatever the weight dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from banyan.kernels import fused_ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., dim]. Same op order as HF (normalize in fp32, cast back, then scale) so bf16
        # results round identically.
        # F.rms_norm is one fused op for what HF writes as five (x * rsqrt(mean(x^2) + eps)),
        # bit-identical in float32 (tested against transformers).
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * h.to(x.dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pre-norm step of a decoder layer: residual + x, then its norm.
        x, residual: [T, dim]; residual None means x is the stream itself (the first layer).
        -> (normed [T, dim], the new residual stream). The native kernel updates `residual`
        in place, so it must be a tensor the caller owns; with residual None, x becomes the
        stream and the next call updates it in place (the model's embedding output is a fresh
        tensor: an input that is not would need a clone)."""
        if x.dim() == 2:
            fused = fused_ops.add_rms_norm(x, residual, self.weight, self.eps)
            if fused is not None:
                return fused
        stream = x if residual is None else residual + x
        return self(stream), stream

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
