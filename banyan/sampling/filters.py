"""Top-k / top-p / min-p filtering and the draw itself, vectorised over rows.

A draw is an inverse-CDF lookup: one uniform u in [0, 1) per row, and the token is the first whose
cumulative probability exceeds u times the total. The cumulative sum is taken in float64, so even
a 128k-token vocabulary loses nothing to rounding (float32 would swallow the tail tokens whose
probability is below the running sum's ulp), and one number per row is all the randomness needed:
a seeded row's u comes straight from its seed, so nothing it draws depends on the batch.

Rows with top-k or top-p are drawn from their tokens sorted by decreasing logit. Sorting a whole
vocabulary row is slow on a CPU (a [32, 128k] sort takes ~0.45 s on two cores, a top-1024 ~25 ms),
so a sampler may first look at the top `candidates` tokens only: exact for a row whose top-k fits
there or whose top-p nucleus does, and the other rows fall back to the full sort. Both draw in the
same order, so a row gets the same token for the same u whichever way it went (up to float
rounding in the last bits of a softmax, which moves a boundary of the CDF by ~1e-7).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

NEG_INF = float("-inf")


def inverse_cdf(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Column index drawn from softmax(logits) per row ([n, K] logits, -inf for removed tokens;
    u [n] float64 in [0, 1)). A token of probability 0 is never drawn: its cumulative value equals
    its predecessor's, and the lookup takes the first value strictly above the target."""
    cdf = torch.cumsum(logits.softmax(dim=-1), dim=-1, dtype=torch.float64)
    target = (u * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=logits.shape[1] - 1)


def min_p_mask(logits: torch.Tensor, max_logit: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Tokens with p < min_p * p_max, i.e. logit < max_logit + log(min_p): no softmax needed,
    and min_p = 0 gives a threshold of -inf (nothing removed)."""
    return logits < max_logit + torch.log(min_p).unsqueeze(1)


def sample_plain(logits: torch.Tensor, min_p: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor:
    """Rows without top-k / top-p: draw in vocabulary order, no sort."""
    if min_p is not None:
        logits = logits.masked_fill(
            min_p_mask(logits, logits.amax(dim=-1, keepdim=True), min_p), NEG_INF
        )
    return inverse_cdf(logits, u)


@dataclass(slots=True)
class SortedDraw:
    tokens: torch.Tensor  # [n] vocabulary ids
    complete: torch.Tensor  # [n] bool: False where the candidates did not hold the row's support


def keep_mask_sorted(
    values: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor | None,
    log_norm: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of the descending-sorted `values` [n, K] survive top-k, then top-p, then min-p.

    top_k [n] long (>= K means no cut), top_p [n] in (0, 1], log_norm [n] the log of the
    normaliser the top-p masses are measured against (log-sum-exp of the tokens top-k keeps).
    A token survives top-p when the tokens strictly more likely than it hold less than p: the
    smallest set reaching p. Returns (keep [n, K] bool, mass [n]: the top-k-kept probability
    mass among these K values, to tell whether a top-p nucleus ended inside them).
    """
    positions = torch.arange(values.shape[1], device=values.device).unsqueeze(0)
    keep = positions < top_k.unsqueeze(1)
    probs = torch.exp(values - log_norm.unsqueeze(1)).masked_fill_(~keep, 0.0)
    cumulative = probs.cumsum(dim=-1)
    # top_p = 1 is no cut at all, even where rounding lets the running sum pass 1 in the tail.
    keep &= ((cumulative - probs) < top_p.unsqueeze(1)) | (top_p >= 1.0).unsqueeze(1)
    if min_p is not None:
        keep &= ~min_p_mask(values, values[:, :1], min_p)
    keep[:, 0] = True  # the most likely token survives any rounding
    return keep, cumulative[:, -1]


def sample_sorted(
    values: torch.Tensor,
    ids: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor | None,
    u: torch.Tensor,
    vocab_size: int,
    full_log_norm: torch.Tensor | None = None,
) -> SortedDraw:
    """Filter and draw from descending-sorted `values` [n, K] whose vocabulary ids are `ids`.

    top_k [n] long, vocab_size for rows without top-k. With K < vocab_size (candidates),
    `full_log_norm` [n] is the log-sum-exp of each whole row, the top-p normaliser of rows
    without top-k. A row is complete when its top-k fits in K, or it has no top-k and its top-p
    nucleus ends inside the K candidates; the draw of an incomplete row is meaningless.
    """
    k_cap = values.shape[1]
    fits = top_k <= k_cap
    outside_top_k = torch.arange(k_cap, device=values.device).unsqueeze(0) >= top_k.unsqueeze(1)
    log_norm = torch.logsumexp(values.masked_fill(outside_top_k, NEG_INF), dim=-1)
    complete = fits
    if full_log_norm is not None:
        log_norm = torch.where(fits, log_norm, full_log_norm)
    keep, mass = keep_mask_sorted(values, top_k, top_p, min_p, log_norm)
    if full_log_norm is not None:
        complete = fits | ((top_k >= vocab_size) & (mass >= top_p))
    position = inverse_cdf(values.masked_fill(~keep, NEG_INF), u)
    return SortedDraw(ids.gather(1, position.unsqueeze(1)).squeeze(1), complete)


def sort_descending(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows sorted by decreasing logit, equal logits by increasing id: one order for every
    path, so a draw does not depend on which one a row took."""
    return logits.sort(dim=-1, descending=True, stable=True)


def top_candidates(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest logits of each row [n, V] (k < V), in decreasing order, equal logits by
    increasing id (the order of `sort_descending`), and their ids. On a CPU the k are chosen
    by numpy's partition (torch 2.13's CPU topk took 2-5x longer: Zen 3, 64 x 49,152, k =
    1,024), or by topk for a small k (as fast there), then ordered by numpy."""
    vocab = logits.shape[1]
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        return logits.topk(k, dim=-1, sorted=True)  # (no sampler uses candidates there)
    a = logits.numpy()
    if k >= 128:
        ids = np.argpartition(a, vocab - k, axis=1)[:, vocab - k:]
        values = np.take_along_axis(a, ids, axis=1)
    else:
        values_t, ids_t = logits.topk(k, dim=-1, sorted=False)
        values, ids = values_t.numpy(), ids_t.numpy()
    order = np.lexsort((ids, -values), axis=1)
    return (torch.from_numpy(np.take_along_axis(values, order, axis=1)),
            torch.from_numpy(np.take_along_axis(ids, order, axis=1).astype(np.int64, copy=False)))


def sample_top_k_top_p(
    logits: torch.Tensor,
    top_k: list[int],
    top_p: list[float],
    min_p: torch.Tensor | None,
    u: torch.Tensor,
    candidates: int | None,
) -> torch.Tensor:
    """Draw one token per row of `logits` [n, V] under top-k (V or more: none), top-p and min-p.

    candidates: look at the top this-many tokens first (None: sort whole rows). Which rows fall
    back to a full sort depends only on each row's own logits and parameters, never on the
    batch: K is `candidates` whenever a row might need more, else the largest top-k.
    """
    n, vocab_size = logits.shape
    device = logits.device
    k_tensor = torch.tensor(top_k, dtype=torch.long, device=device)
    p_tensor = torch.tensor(top_p, dtype=torch.float32, device=device)
    if candidates is None or candidates >= vocab_size:
        values, ids = sort_descending(logits)
        return sample_sorted(values, ids, k_tensor, p_tensor, min_p, u, vocab_size).tokens

    k_cap = candidates if max(top_k) > candidates else max(top_k)
    values, ids = top_candidates(logits, k_cap)
    full_log_norm = torch.logsumexp(logits, dim=-1) if max(top_k) > k_cap else None
    draw = sample_sorted(values, ids, k_tensor, p_tensor, min_p, u, vocab_size, full_log_norm)
    # A host sync, cheap on the CPU where candidates are used (a GPU sorts instead).
    redo = (~draw.complete).nonzero().squeeze(1)
    if redo.numel() and 8 * k_cap < vocab_size:
        # Most nuclei past the candidates end within 8x as many (a partition and a sort of
        # those cost a fraction of sorting the whole row).
        assert full_log_norm is not None  # (rows whose top-k fits are complete)
        again = sample_sorted(*top_candidates(logits.index_select(0, redo), 8 * k_cap),
                              k_tensor[redo], p_tensor[redo],
                              None if min_p is None else min_p[redo], u[redo], vocab_size,
                              full_log_norm[redo])
        draw.tokens.index_copy_(0, redo, again.tokens)
        redo = redo[~again.complete]
    if not redo.numel():
        return draw.tokens
    values, ids = sort_descending(logits.index_select(0, redo))
    again = sample_sorted(
        values, ids, k_tensor[redo], p_tensor[redo],
        None if min_p is None else min_p[redo], u[redo], vocab_size,
    )
    return draw.tokens.index_copy_(0, redo, again.tokens)
