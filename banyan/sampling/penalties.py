"""Logits processors applied to the raw model logits before temperature: repetition, frequency and
presence penalties, logit bias, and the min_new_tokens ban on stop tokens.

Each works on a [n, V] float32 tensor in place and is vectorised over the batch; the per-row Python
work is only gathering the row's token ids into one flat list (O(tokens), never O(V)).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from banyan.batch import SamplingRow


@dataclass(slots=True)
class TokenStats:
    """Per row, how often each token appears in the output and whether it appears in the prompt."""

    output_counts: torch.Tensor  # [n, V] float32
    prompt_mask: torch.Tensor | None  # [n, V] bool; None when no row has a repetition penalty


def _flat_index(
    id_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """Indices into a flattened [n, V] tensor of every (row, token id) pair, ids out of range
    dropped: a bad id in one request must not fail the step for all."""
    lengths = torch.tensor([len(ids) for ids in id_lists], dtype=torch.long, device=device)
    flat_ids = [t for ids in id_lists for t in ids]
    ids = torch.tensor(flat_ids, dtype=torch.long, device=device)
    rows = torch.repeat_interleave(torch.arange(len(id_lists), device=device), lengths)
    valid = (ids >= 0) & (ids < vocab_size)
    return (rows * vocab_size + ids)[valid]


def token_stats(
    rows: Sequence[SamplingRow], vocab_size: int, device: torch.device, need_prompt: bool
) -> TokenStats:
    n = len(rows)
    flat = _flat_index([r.output_ids for r in rows], vocab_size, device)
    counts = torch.bincount(flat, minlength=n * vocab_size).view(n, vocab_size).float()
    prompt_mask = None
    if need_prompt:
        flat = _flat_index([r.prompt_ids for r in rows], vocab_size, device)
        prompt_mask = torch.zeros(n * vocab_size, dtype=torch.bool, device=device)
        prompt_mask[flat] = True
        prompt_mask = prompt_mask.view(n, vocab_size)
    return TokenStats(counts, prompt_mask)


def apply_penalties(
    logits: torch.Tensor,
    stats: TokenStats,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """Penalise `logits` [n, V] in place and return it. `repetition`, `frequency`, `presence` are
    [n] float32 (1.0, 0.0, 0.0 mean off for that row).

    repetition (HF/CTRL): for tokens seen in prompt or output, logit > 0 -> logit / p, else
    logit * p (dividing a negative logit would raise it, hence the two cases).
    frequency (OpenAI): logit -= f * count in output.  presence (OpenAI): logit -= p * [count > 0].
    """
    counts = stats.output_counts
    in_output = counts > 0
    seen = in_output if stats.prompt_mask is None else in_output | stats.prompt_mask
    rep = repetition.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(seen, penalised, logits))
    logits.sub_(frequency.unsqueeze(1) * counts)
    logits.sub_(presence.unsqueeze(1) * in_output.float())
    return logits


def apply_penalties_to_rows(
    logits: torch.Tensor, rows: Sequence[SamplingRow], row_indices: list[int]
) -> None:
    """Apply each row's penalties to `logits` [B, V] in place, for the batch rows in
    `row_indices` (the rows that use any penalty)."""
    device = logits.device
    subset = [rows[i] for i in row_indices]
    params = [r.params for r in subset]
    values = torch.tensor(
        [[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in params],
        dtype=torch.float32,
        device=device,
    )
    need_prompt = any(p.repetition_penalty != 1.0 for p in params)
    stats = token_stats(subset, logits.shape[1], device, need_prompt)
    index = torch.tensor(row_indices, dtype=torch.long, device=device)
    block = logits.index_select(0, index)
    apply_penalties(block, stats, values[:, 0], values[:, 1], values[:, 2])
    logits.index_copy_(0, index, block)


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Add each row's logit_bias to `logits` [B, V] in place."""
    vocab_size = logits.shape[1]
    row_idx: list[int] = []
    tok_idx: list[int] = []
    bias: list[float] = []
    for i, row in enumerate(rows):
        for token_id, value in row.params.logit_bias.items():
            if 0 <= token_id < vocab_size:
                row_idx.append(i)
                tok_idx.append(token_id)
                bias.append(value)
    if not row_idx:
        return
    device = logits.device
    logits.index_put_(
        (torch.tensor(row_idx, device=device), torch.tensor(tok_idx, device=device)),
        torch.tensor(bias, dtype=logits.dtype, device=device),
        accumulate=True,
    )


def keep_allowed_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow],
                        indices: Sequence[int]) -> None:
    """Rows `indices` (those with allowed_token_ids): every other token's logit -inf, in
    place."""
    for i in indices:
        ids = torch.tensor(rows[i].params.allowed_token_ids, dtype=torch.long,
                           device=logits.device)
        keep = logits[i].index_select(0, ids)
        logits[i].fill_(-math.inf)
        logits[i].index_copy_(0, ids, keep)


def bad_word_bans(rows: Sequence[SamplingRow]) -> list[tuple[int, int]]:
    """(row, token id) pairs to ban for bad words: each sequence's last token where the row's
    output ends with the tokens before it."""
    bans: list[tuple[int, int]] = []
    for i, row in enumerate(rows):
        out = row.output_ids
        for word in row.params.bad_words_ids:
            n = len(word) - 1
            if n == 0 or (len(out) >= n and out[len(out) - n:] == word[:n]):
                bans.append((i, word[-1]))
    return bans


def min_tokens_bans(rows: Sequence[SamplingRow], eos_token_ids: set[int]) -> list[tuple[int, int]]:
    """(row, token id) pairs to ban: the stop tokens of rows that have not yet produced
    min_new_tokens. Stop tokens are the row's stop_token_ids plus EOS unless ignore_eos (which
    already keeps EOS from ending the request)."""
    bans: list[tuple[int, int]] = []
    for i, row in enumerate(rows):
        params = row.params
        if row.generated >= params.min_new_tokens:
            continue
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= eos_token_ids
        bans.extend((i, t) for t in stops)
    return bans


def apply_bans(logits: torch.Tensor, bans: list[tuple[int, int]]) -> None:
    vocab_size = logits.shape[1]
    bans = [(r, t) for r, t in bans if 0 <= t < vocab_size]
    if not bans:
        return
    device = logits.device
    rows = torch.tensor([r for r, _ in bans], dtype=torch.long, device=device)
    toks = torch.tensor([t for _, t in bans], dtype=torch.long, device=device)
    logits[rows, toks] = float("-inf")
