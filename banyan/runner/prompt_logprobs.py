"""Prompt logprobs in the forward: the log-softmax of the logits at prompt positions, only for
the requests that ask (everyone else keeps last-position-only logits).

A span of a request's new tokens at positions p..p+c-1 scores the prompt tokens p+1..p+c (the
token at each position predicts the next one). The logits of a span are computed from the
step's hidden states a slice of rows at a time, so a long prompt never holds a whole
[prompt, vocab] float32 matrix (49,152 columns x 4 bytes = 192 KiB per position).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from banyan.batch import ForwardBatch, TokenLogprobs

# Positions whose logits are computed at once: 256 x 49,152 float32 = 48 MiB at SmolLM2's vocab.
LOGIT_ROWS_PER_SLICE = 256


@dataclass(slots=True)
class PromptLogprobInputs:
    """A step's prompt-logprob positions as tensors (built once in ModelRunner.prepare)."""

    flat: torch.Tensor  # [P] int64 flat index into the step's tokens
    targets: torch.Tensor  # [P] int64 the prompt token each position is scored against
    counts: list[int]  # positions per span, in ForwardBatch.prompt_logprobs order
    top_ks: list[int]  # [P] alternatives wanted at each position


def prompt_logprob_inputs(batch: ForwardBatch, starts: list[int],
                          device: torch.device) -> PromptLogprobInputs | None:
    """starts[i]: flat index of batch entry i's first new token."""
    if not batch.prompt_logprobs:
        return None
    flat: list[int] = []
    targets: list[int] = []
    top_ks: list[int] = []
    for span in batch.prompt_logprobs:
        if span.count > batch.extend_lens[span.index]:
            raise ValueError(f"ForwardBatch: a prompt-logprob span of {span.count} positions "
                             f"exceeds its extend of {batch.extend_lens[span.index]}")
        first = starts[span.index]
        flat.extend(range(first, first + span.count))
        targets.extend(span.targets)
        top_ks.extend([span.top_k] * span.count)
    return PromptLogprobInputs(torch.tensor(flat, dtype=torch.int64).to(device),
                               torch.tensor(targets, dtype=torch.int64).to(device),
                               [s.count for s in batch.prompt_logprobs], top_ks)


def compute_prompt_logprobs(hidden: torch.Tensor,
                            logits_of: Callable[[torch.Tensor], torch.Tensor],
                            inputs: PromptLogprobInputs) -> list[list[TokenLogprobs]]:
    """hidden: [T, hidden] of the whole step; logits_of: hidden rows -> float32 logits. One list
    of TokenLogprobs per span."""
    entries: list[TokenLogprobs] = []
    total = inputs.flat.shape[0]
    for a in range(0, total, LOGIT_ROWS_PER_SLICE):
        b = min(a + LOGIT_ROWS_PER_SLICE, total)
        logprobs = torch.log_softmax(logits_of(hidden.index_select(0, inputs.flat[a:b])).float(),
                                     dim=-1)
        chosen_t = logprobs.gather(1, inputs.targets[a:b].unsqueeze(1))
        ranks = ((logprobs > chosen_t).sum(dim=1) + 1).tolist()
        chosen = chosen_t.squeeze(1).tolist()
        ids = inputs.targets[a:b].tolist()
        ks = inputs.top_ks[a:b]
        max_k = min(max(ks), logprobs.shape[1])
        top_values: list[list[float]] = []
        top_ids: list[list[int]] = []
        if max_k > 0:
            values, indices = logprobs.topk(max_k, dim=-1, sorted=True)
            top_values, top_ids = values.tolist(), indices.tolist()
        for j, k in enumerate(ks):
            entry = TokenLogprobs(ids[j], chosen[j], rank=ranks[j])
            if k > 0:
                entry.top_ids, entry.top_logprobs = top_ids[j][:k], top_values[j][:k]
            entries.append(entry)
    out: list[list[TokenLogprobs]] = []
    at = 0
    for count in inputs.counts:
        out.append(entries[at : at + count])
        at += count
    return out
