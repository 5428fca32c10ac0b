"""Whether a native kernel replaces F.linear for a weight shape: measured on this machine, with
a margin (SkinnyF32Method in layers/f32_linear.py asks, and remembers the answer per machine
and build).
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

logger = logging.getLogger(__name__)


# A kernel replaces F.linear only when it measures at most this share of F.linear's time. With
# no margin, near-ties went either way from one build of the kernels to the next (their answers
# are remembered per build): on one Zen 4 machine 21 of the 53 answers remembered there
# flipped between builds, and with them the float32 sums' last bits (the fixed text's
# perplexity over an int8 KV cache moved +0.11% -> +0.17% on a comment's change). A tie keeps
# F.linear, transformers' own GEMM.
CHOICE_MARGIN = 0.9
CHOICE_RULE = " (10% margin)"  # in the remembered questions: answers of the old rule not reused


def beats_linear(name: str, fn: object, weight: torch.Tensor, rows: int, reps: int) -> bool:
    """Whether fn(x, weight, None) takes at most CHOICE_MARGIN of F.linear's time for `rows`
    random tokens: medians of `reps` timed calls each, after one that warms caches and
    threads."""
    x = torch.randn(rows, weight.shape[1])

    def median(call: object) -> float:
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            call()  # type: ignore[operator]
            times.append(time.perf_counter() - t0)
        return sorted(times[1:])[reps // 2]

    with torch.inference_mode():
        library = median(lambda: nn.functional.linear(x, weight))
        other = median(lambda: fn(x, weight, None))  # type: ignore[operator]
    logger.info("%s %s: %.2f ms vs F.linear %.2f ms at %d rows", name, tuple(weight.shape),
                other * 1e3, library * 1e3, rows)
    return other < library * CHOICE_MARGIN
