"""Greedy tokens: the index of each row's largest logit.

On CPU through numpy: torch 2.13's CPU argmax (and max over a dim) is a scalar loop, ~10x
slower than numpy's vectorised one (Zen 3, float32: 64 x 49,152 logits 3.9 ms against 0.41
ms; 256 x 512 207 against 22 us), and it runs once per decode step. Both return the first
maximal index of a row, so the tokens are the same.
"""

from __future__ import annotations

import numpy as np
import torch

_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B] int64 on the logits' device."""
    if logits.device.type == "cpu" and logits.dtype in _NUMPY_DTYPES and logits.dim() == 2 \
            and not logits.requires_grad:
        return torch.from_numpy(np.argmax(logits.numpy(), axis=1).astype(np.int64, copy=False))
    return logits.argmax(dim=-1)


def top_token_and_probability(logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """Each row's argmax and its softmax probability (a draft's confidence in its guess)."""
    rows = logits.float().cpu().numpy()
    top = np.argmax(rows, axis=1)
    best = rows[np.arange(len(rows)), top]
    mass = np.exp(rows - best[:, None]).sum(axis=1)  # the top logit's term is 1
    return top.tolist(), (1.0 / mass).tolist()
