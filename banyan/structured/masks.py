"""Token masks from grammar states, for the sampler: one bitmask row per logit row.

A request with k proposed tokens has k + 1 logit rows (speculative decoding); its state fills
the mask for each position as if the proposals before it were accepted (`GrammarState.fill`).
The sampler applies the mask to the raw logits before penalties and temperature, and the runner
then advances each state by the tokens the step accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from banyan.batch import SamplingRow

_BITS = torch.arange(32, dtype=torch.int32)


@dataclass(slots=True)
class TokenMasks:
    """bitmask [R, ceil(V / 32)] int32 (bit b of word w allows token 32 w + b) for the logit
    rows `rows`."""

    bitmask: torch.Tensor
    rows: list[int]

    def apply(self, logits: torch.Tensor) -> None:
        """Set disallowed tokens of the masked rows of `logits` [B, V] to -inf, in place.

        xgrammar's kernel where it applies (float32, contiguous): on CPU it is one tight
        single-threaded loop, 0.07-0.2 ms for a 49k vocabulary, where the torch ops below (unpack
        bits, masked_fill) are small parallel ops costing tens of ms on a busy 2-core host."""
        vocab = logits.shape[1]
        if logits.dtype == torch.float32 and logits.is_contiguous():
            from xgrammar import apply_token_bitmask_inplace

            bitmask, indices = self.bitmask, None
            if len(self.rows) != logits.shape[0]:  # its indices address rows of both tensors
                bitmask = self.bitmask.new_full((logits.shape[0], self.bitmask.shape[1]), -1)
                bitmask[self.rows] = self.bitmask
                indices = self.rows
            apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=vocab,
                                        indices=indices)
            return
        self._apply_torch(logits)

    def _apply_torch(self, logits: torch.Tensor) -> None:
        vocab = logits.shape[1]
        allowed = ((self.bitmask.unsqueeze(-1) >> _BITS) & 1).bool()
        allowed = allowed.view(len(self.rows), -1)[:, :vocab].to(logits.device)
        if len(self.rows) == logits.shape[0]:
            logits.masked_fill_(~allowed, float("-inf"))
            return
        index = torch.tensor(self.rows, dtype=torch.long, device=logits.device)
        logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(
            ~allowed, float("-inf")))


def fill_token_masks(sampling: Sequence[SamplingRow], proposed: Sequence[list[int]],
                     vocab_size: int) -> TokenMasks | None:
    """The masks of a step's logit rows (None when no request has a grammar). `proposed` is
    ForwardBatch.proposed (empty: no request proposed anything)."""
    if all(r.grammar is None for r in sampling):
        return None
    counts = [len(p) + 1 for p in proposed] if proposed else [1] * len(sampling)
    masked: list[int] = []
    at = 0
    for row, count in zip(sampling, counts, strict=True):
        if row.grammar is not None:
            masked.extend(range(at, at + count))
        at += count
    bitmask = torch.empty(len(masked), (vocab_size + 31) // 32, dtype=torch.int32)
    at = filled = 0
    for i, (row, count) in enumerate(zip(sampling, counts, strict=True)):
        if row.grammar is not None:
            row.grammar.fill(bitmask, filled, proposed[i] if proposed else [])
            filled += count
        at += count
    return TokenMasks(bitmask, masked)


def advance_grammars(sampling: Sequence[SamplingRow], tokens: Sequence[list[int]]) -> None:
    """Advance each request's grammar by the tokens the step gave it (in step order)."""
    for row, accepted in zip(sampling, tokens, strict=True):
        if row.grammar is not None:
            row.grammar.advance(accepted)
