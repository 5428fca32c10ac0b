"""Rotary position embedding (RoPE), matching Hugging Face's frequencies exactly.

The inverse frequencies come from transformers' own `ROPE_INIT_FUNCTIONS` (linear, llama3, yarn)
or the same formula as its default, so scaled variants cannot drift from the reference. They
stay float32 whatever the model dtype; cos/sin are computed per step from the positions of the
flat batch (no cache sized by max_position_embeddings, which is 128K for Llama 3).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# RoPE variants whose frequencies do not depend on the sequence length, so one inv_freq serves
# every step. "dynamic" and "longrope" change with the length seen so far: refused.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_inv_freq(
    hf_config: Any, rope_type: str, rope_theta: float, head_dim: int
) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] float32 on CPU, attention_scaling applied to cos/sin)."""
    if rope_type == "dynamic":
        raise ValueError(
            "rope_type 'dynamic' is not supported (its frequencies depend on the length)"
        )
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    # Always real CPU tensors, even when the model is being built under a meta-device context.
    with torch.device("cpu"):
        if rope_type == "default":
            # HF's compute_default_rope_parameters, which is not in ROPE_INIT_FUNCTIONS.
            exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
            return 1.0 / (rope_theta**exponent), 1.0
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    def __init__(self, hf_config: Any, rope_type: str, rope_theta: float, head_dim: int) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(hf_config, rope_type, rope_theta, head_dim)
        if inv_freq.shape != (head_dim // 2,):
            raise ValueError(
                f"RoPE inv_freq has shape {tuple(inv_freq.shape)}, expected ({head_dim // 2},)"
            )
        # Not in checkpoints (persistent=False); the loader moves it to the device, keeping fp32.
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] -> cos, sin: [T, head_dim // 2] in dtype. Computed in fp32 then cast,
        # like HF (which builds [T, head_dim] = cat(freqs, freqs): the same values twice).
        freqs = torch.outer(positions.float(), self.inv_freq)  # positions[:, None] * inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        # (x * 1.0 is x bit for bit: skipped, two ops less a decode step, where each op's call
        # costs more than its work)
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim], cos/sin: [T, head_dim // 2] -> rotated x (NeoX/HF half layout).

    Equals HF's `x * cos + rotate_half(x) * sin` bit for bit: the same products and sums per
    element, only without materialising the duplicated cos/sin halves.
    """
    x1, x2 = x.chunk(2, dim=-1)  # [T, h, D/2] each
    c = cos[:, None, :]
    s = sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
