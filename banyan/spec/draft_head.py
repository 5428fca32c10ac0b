"""A draft model's guesses from half its LM head's bytes: every logit from a 4-bit copy of the
head, the few near the largest recomputed from the head's values, in one native call.

The head is the largest single read of a small draft's forward (SmolLM2-135M's Q8_0 embedding:
31.8 MB, 1.0-1.3 ms of a 4.7-5.1 ms draft forward at batch 1 on Zen 4, and a guessing step runs
~8 such forwards). A guess needs the draft's argmax and how sure it is, not its exact logits,
and the target checks every guess: a guess that differs costs acceptance, never output. The 4-bit
copy (int4, group 32: 15.9 MB) alone agreed with the Q8_0 argmax at 91% of 593 chat positions;
the Q8_0 argmax was among its 4 largest logits at 99.7% and among its 8 largest at all. So
`banyan_draft_pick` (kernels/cpu_draft_pick.cpp) recomputes each row's logits within MARGIN of
its largest (at most CANDIDATES of them) from the head's values (kept row-major in bf16) and
takes the best; the probability is that logit's softmax over the copy's logits. Done in Python
(topk, gather, scatter, numpy's exp-sum) the same steps cost as much as the bytes saved.
"""

from __future__ import annotations

import logging

import torch

from banyan.kernels import native
from banyan.layers.linear import Linear
from banyan.layers.quant import Int4Method, quantization_runs
from banyan.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

CANDIDATES = 16  # twice the most the 4-bit copy needed to hold the Q8_0 argmax (8)
MARGIN = 3.0  # logits this close to the copy's largest are recomputed (its errors: ~0.1-0.3)
# A head below this is read in a few microseconds anyway (and the tests' tiny models keep the
# plain path); SmolLM2's 49,152 x 576 is 28-113 MB by its format.
MIN_HEAD_BYTES = 4 << 20
GROUP = 32


class DraftHead:
    """`pick(hidden)` -> (each row's guess, the draft's probability of it)."""

    def __init__(self, weight: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """weight: the head's values [V, K], float32; rows: the same in bf16 where the model
        holds them already (a tied head's embedding), else a copy is made."""
        self.screen = Linear.from_weight(weight)
        self.screen.convert(Int4Method(GROUP))
        # [V, K], read a few rows a call
        self.rows = rows if rows is not None else weight.to(torch.bfloat16).contiguous()
        self.vocab, self.width = weight.shape

    @classmethod
    def build(cls, model: LlamaForCausalLM, device: torch.device, dtype: torch.dtype,
              min_bytes: int = MIN_HEAD_BYTES) -> DraftHead | None:
        """The head's 4-bit pick where it reads fewer bytes: a bf16 draft on a CPU whose int4
        kernels run, its head not already 4-bit nor small; else None (the plain logits)."""
        head = model.lm_head if model.lm_head is not None else model.tied_head
        if (dtype != torch.bfloat16 or device.type != "cpu" or native.load() is None
                or not quantization_runs("int4", device, dtype) or model.config.hidden % GROUP):
            return None
        if head is not None and isinstance(head.method, Int4Method):
            return None
        weight = _head_values(model, head)
        if weight is None or weight.numel() * 2 < min_bytes:
            return None
        embedding = model.embed_tokens.weight.detach()
        shared = (model.lm_head is None and embedding.dtype == torch.bfloat16
                  and embedding.is_contiguous())
        built = cls(weight, embedding if shared else None)  # (tied: 57 MB not copied again)
        logger.info("draft LM head picked from a 4-bit copy (%.1f MB a forward)",
                    built.screen.weight_bytes() / 1e6)
        return built

    def pick(self, hidden: torch.Tensor) -> tuple[list[int], list[float]]:
        """hidden [T, K] (the final-normed rows that sample) -> guesses and probabilities."""
        x = hidden.to(torch.bfloat16).contiguous()
        approx = self.screen(x)  # [T, V] bf16
        rows = x.shape[0]
        token = torch.empty(rows, dtype=torch.int64)
        prob = torch.empty(rows, dtype=torch.float32)
        lib = native.load()
        assert lib is not None, "checked at build"
        with native.kernel_range("banyan::draft_pick"):
            lib.banyan_draft_pick(approx.data_ptr(), rows, self.vocab, x.data_ptr(), self.width,
                                  self.rows.data_ptr(), CANDIDATES, MARGIN, token.data_ptr(),
                                  prob.data_ptr())
        return token.tolist(), prob.tolist()


def _head_values(model: LlamaForCausalLM, head: Linear | None) -> torch.Tensor | None:
    """The head's values as float32 [V, K] (an oneDNN-packed head's read back through its
    GEMM), or None where none are at hand; a tied head without them is the embedding as
    loaded."""
    if head is not None:
        dequantized = getattr(head.method, "dequantized_weight", None)
        if dequantized is not None:
            return dequantized(head).float()
        if hasattr(head, "weight"):
            return head.weight.detach().float()
    return model.embed_tokens.weight.detach().float() if model.lm_head is None else None
