"""Rotary position embedding (RoPE), matching Hugging Face's frequencies exactly.

The inverse frequencies of the unscaled, linear and llama3 kinds are computed here with
transformers' arithmetic, operation for operation (tested bit for bit against its
`ROPE_INIT_FUNCTIONS`), so that a model folder loads without importing transformers (~1-4 s of
an engine start); YaRN's come from transformers itself, its config object standardising the
parameters. They stay float32 whatever the model dtype; cos/sin are computed per step from the
positions of the flat batch (no cache sized by max_position_embeddings, which is 128K for
Llama 3).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

# RoPE variants whose frequencies do not depend on the sequence length, so one inv_freq serves
# every step. "dynamic" and "longrope" change with the length seen so far: refused.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _parameter(params: dict[str, Any], name: str) -> float:
    value = params.get(name)
    if value is None:
        raise ValueError(f"rope_parameters of rope_type {params.get('rope_type')!r} need {name!r}")
    return float(value)


def _unscaled_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta**exponent)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's smoothing: long wavelengths divided by the factor, short ones kept, the band
    between interpolated (the expressions in transformers' order, for the same roundings)."""
    factor = _parameter(params, "factor")
    low, high = _parameter(params, "low_freq_factor"), _parameter(params, "high_freq_factor")
    old_context = _parameter(params, "original_max_position_embeddings")
    if high <= low:  # (transformers only warns, then divides by zero)
        raise ValueError(f"rope_parameters: high_freq_factor ({high}) must exceed "
                         f"low_freq_factor ({low})")
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_inv_freq(
    rope_parameters: dict[str, Any], head_dim: int, hf_config: Any = None
) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] float32 on CPU, attention_scaling applied to cos/sin), from
    the model's resolved rope_parameters (rope_type, rope_theta, the kind's own); YaRN needs
    transformers' config object as well."""
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type == "dynamic":
        raise ValueError(
            "rope_type 'dynamic' is not supported (its frequencies depend on the length)"
        )
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    # Always real CPU tensors, even when the model is being built under a meta-device context.
    with torch.device("cpu"):
        if rope_type == "yarn":
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS["yarn"](hf_config, torch.device("cpu"))
            return inv_freq.float(), float(scaling)
        inv_freq = _unscaled_inv_freq(_parameter(rope_parameters, "rope_theta"), head_dim)
        if rope_type == "linear":
            inv_freq = inv_freq / _parameter(rope_parameters, "factor")
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_parameters)
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    def __init__(self, rope_parameters: dict[str, Any], head_dim: int,
                 hf_config: Any = None) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(rope_parameters, head_dim, hf_config)
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
