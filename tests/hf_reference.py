"""Hugging Face transformers as the oracle: greedy generation in float32, one request at a time."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch


@lru_cache(maxsize=8)
def hf_model(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def hf_greedy(path: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers.generate, greedy, alone (no padding); stops at the model's EOS like Banyan."""
    model = hf_model(str(path))
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                             do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()
