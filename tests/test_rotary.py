"""RoPE frequencies computed without transformers equal its own, bit for bit."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from banyan.layers.rotary import rope_inv_freq

HEAD_DIMS = (16, 32, 64, 80, 128)
THETAS = (10_000.0, 500_000.0, 1_000_000.0)


def _theirs(params: dict[str, object], head_dim: int) -> tuple[torch.Tensor, float]:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                         rope_parameters=dict(params))
    if params["rope_type"] == "default":  # (not in ROPE_INIT_FUNCTIONS: its rotary class's)
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[params["rope_type"]](config, torch.device("cpu"))


LLAMA3 = [dict(factor=f, low_freq_factor=lo, high_freq_factor=hi,
               original_max_position_embeddings=ctx)
          for f, lo, hi, ctx in [(8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192),
                                 (4.0, 1.0, 4.0, 64), (2.0, 2.0, 8.0, 1024)]]
CASES = [dict(rope_type="default")] + [dict(rope_type="linear", factor=f) for f in (2, 4.0)] + \
    [dict(rope_type="llama3", **p) for p in LLAMA3]


@pytest.mark.parametrize("params", CASES, ids=lambda p: p["rope_type"])
def test_inv_freq_equals_transformers(params: dict[str, object]) -> None:
    for head_dim, theta in itertools.product(HEAD_DIMS, THETAS):
        full = {**params, "rope_theta": theta}
        ours, scaling = rope_inv_freq(full, head_dim, SimpleNamespace())
        theirs, their_scaling = _theirs(full, head_dim)
        assert ours.dtype == torch.float32 and scaling == their_scaling
        assert torch.equal(ours, theirs.float()), (full, head_dim)


def test_a_missing_or_impossible_parameter_is_named() -> None:
    with pytest.raises(ValueError, match="low_freq_factor"):
        rope_inv_freq({"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, 64)
    with pytest.raises(ValueError, match="high_freq_factor"):
        rope_inv_freq({"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0,
                       "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}, 64)
