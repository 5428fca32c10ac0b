"""The int8 copy of a bf16 LM head and the per-row bounds that let a one-token greedy step read
about half of the head and still take the whole head's token (kernels/cpu_head_screen.cpp
states the bound and why it holds).

Made only where the head is a large share of what a step reads (SCREEN_SHARE): SmolLM2's tied
head is 21% of its bf16 bytes, where the screen saves ~8% of a batch-1 step; an 8B model's head
is ~7%, where the copy's memory would buy little.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from banyan.layers.panels import pad_rows, to_panels
from banyan.layers.quant import quantize_int8

GROUP = 32  # inputs a scale of the copy covers (the kernel's int8 group kernel, group 32)
SCREEN_SHARE = 0.1  # the head's least share of a step's weight bytes for a screen to be made
SWITCH = "BANYAN_HEAD_SCREEN"  # "0": no screen (an A/B switch)
_ROWS = 4096  # rows made at a time (float64 temporaries)
_U = 2.0 ** -24  # float32's unit roundoff


@dataclass
class HeadScreen:
    codes: torch.Tensor  # int8 panels, GroupInt8Method's layout
    scale: torch.Tensor  # float32 panels [.., K / GROUP, 16]
    slack: torch.Tensor  # float32 [N]: each row's bound over ||x||, rounded up


def wanted(head_bytes: int, step_bytes: int) -> bool:
    return os.environ.get(SWITCH, "1") != "0" and head_bytes >= SCREEN_SHARE * step_bytes


def make_head_screen(weight: torch.Tensor) -> HeadScreen | None:
    """The screen of a head weight [N, K] (bf16 values), or None where K is not whole groups."""
    n, k = weight.shape
    if k % GROUP:
        return None
    codes, scales, slacks = [], [], []
    for r in range(0, n, _ROWS):
        w = weight[r : r + _ROWS]
        q, scale = quantize_int8(w.reshape(-1, GROUP))  # each group as a row: a scale each
        w = w.double()
        approx = (q.double() * scale.double()[:, None]).view(-1, k)  # exact (8 x 24 bits)
        slack = (w - approx).norm(dim=1) + 2 * (k + k // GROUP) * _U * (
            w.norm(dim=1) + approx.norm(dim=1))
        codes.append(q.view(-1, k))
        scales.append(scale.view(-1, k // GROUP))
        slacks.append(slack * (1 + 1e-6))
    slack = torch.cat(slacks).float()
    slack = torch.nextafter(slack, torch.full_like(slack, float("inf")))  # rounded up
    return HeadScreen(to_panels(pad_rows(torch.cat(codes))),
                      to_panels(pad_rows(torch.cat(scales))), slack)
