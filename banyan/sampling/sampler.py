"""Turns one step's logits into one token per row, vectorised over the batch.

Order (as vLLM / HF): on the raw logits, the grammar's token mask (structured output), penalties,
then logit bias, then the min_new_tokens ban on stop tokens; then, for sampled rows only,
temperature, top-k, top-p, min-p; then one inverse-CDF draw per row (filters.py says why that rather
than an exponential race over the vocabulary).

Randomness is one uniform number per sampled row. A row with a seed takes it from a hash of
(seed, tokens generated so far): its tokens depend only on its own logits and seed, not on the batch
around it or its position there, nor on the device's generator, and a retracted-then-resumed
request draws the same numbers again. Unseeded rows share one batched draw from the engine's
generator, which lives on the logits' device (no host round trip on a GPU).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from banyan.batch import SamplingRow, TokenLogprobs
from banyan.sampling.filters import sample_plain, sample_top_k_top_p
from banyan.sampling.greedy import argmax_rows
from banyan.sampling.logprobs import compute_logprobs
from banyan.sampling.penalties import (
    apply_bans,
    apply_logit_bias,
    bad_word_bans,
    keep_allowed_tokens,
    apply_penalties_to_rows,
    min_tokens_bans,
)
from banyan.structured.masks import TokenMasks

# Top-k/top-p rows look at this many most likely tokens before sorting a whole row (CPU only).
TOP_CANDIDATES = 1024
_MASK64 = (1 << 64) - 1


@dataclass(slots=True)
class SampleResult:
    next_tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy. On CPU through numpy, on one thread: torch's clone of one row of a
    49k vocabulary goes parallel and costs ~4 ms of OpenMP hand-offs on a busy 2-core host,
    a 6% slower batch-1 step with a grammar."""
    if t.device.type != "cpu":
        return t.clone()
    return torch.from_numpy(t.numpy().copy())


def row_seed(row: SamplingRow) -> int | None:
    """The row's own seed wins over the request's: the scheduler gives the n samples of one seeded
    request (n > 1) distinct row seeds so they do not all draw the same tokens."""
    return row.seed if row.seed is not None else row.params.seed


def mix_seed(seed: int, step: int) -> int:
    """A 64-bit hash of (request seed, tokens generated so far): splitmix64's finaliser, so
    neighbouring seeds and steps give unrelated numbers."""
    x = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, step: int) -> float:
    """A uniform in [0, 1) from (seed, step): the top 53 bits of the mixed seed, exactly as a
    float64 holds them."""
    return (mix_seed(seed, step) >> 11) * 2.0**-53


class Sampler:
    """Samples one token per row from [B, V] logits.

    vocab_size: the model's real vocabulary; columns past it (an lm_head padded for alignment)
    are never sampled. device: where logits arrive; the engine generator lives there. seed: seeds
    the engine generator used by unseeded rows (None: nondeterministic). eos_token_ids: the
    model's EOS ids, banned with the row's stop tokens while a row is under min_new_tokens.
    """

    def __init__(
        self,
        vocab_size: int,
        device: torch.device | str = "cpu",
        seed: int | None = None,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.eos_token_ids: set[int] = set(eos_token_ids)
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        # None: always sort whole rows for top-k/top-p (a GPU always does: sorting is cheap there).
        self.top_candidates: int | None = TOP_CANDIDATES

    def sample(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        eos_token_ids: Iterable[int] | None = None,
        token_masks: TokenMasks | None = None,
    ) -> SampleResult:
        """One token per row of `logits` [B, V] (float32; other dtypes are upcast); the input tensor
        is never modified. `eos_token_ids` overrides the constructor's set for this call.
        `token_masks` (structured output) bans tokens first, before penalties and temperature;
        logprobs stay those of the raw logits (vLLM's default)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        if not rows:
            return SampleResult()
        raw = logits[:, : self.vocab_size]
        if raw.dtype != torch.float32:
            raw = raw.float()
        if token_masks is None and all(r.plain for r in rows):  # the usual greedy batch
            return SampleResult(argmax_rows(raw).tolist(), [None] * len(rows))
        eos = self.eos_token_ids if eos_token_ids is None else set(eos_token_ids)
        params = [r.params for r in rows]

        processed = self._process(raw, rows, eos, token_masks)
        greedy = [p.greedy for p in params]
        if all(greedy):
            tokens = argmax_rows(processed)
        else:
            tokens = self._sample_rows(processed, rows, greedy)

        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        logprobs: list[TokenLogprobs | None] = [None] * len(rows)
        if logprob_rows:
            ks = [params[i].logprobs or 0 for i in logprob_rows]
            for i, entry in zip(logprob_rows, compute_logprobs(raw, logprob_rows, ks, tokens)):
                logprobs[i] = entry
        return SampleResult(next_tokens=tokens.tolist(), logprobs=logprobs)

    def _process(
        self, raw: torch.Tensor, rows: Sequence[SamplingRow], eos: set[int],
        token_masks: TokenMasks | None = None,
    ) -> torch.Tensor:
        """Grammar masks, allowed tokens, penalties, logit bias, bad words and min-tokens bans on a
        copy of the raw logits; the raw logits themselves when no row needs any (the common case
        costs nothing). A row whose own bans (allowed tokens, bad words, min_tokens) leave no
        token the grammar allows takes that step's logits with its grammar mask alone, never a
        token picked among -inf."""
        penalty_rows = [i for i, r in enumerate(rows) if r.params.uses_penalties]
        has_bias = any(r.params.logit_bias for r in rows)
        allowed_rows = [i for i, r in enumerate(rows) if r.params.allowed_token_ids is not None]
        bans = min_tokens_bans(rows, eos)
        if any(r.params.bad_words_ids for r in rows):
            bans += bad_word_bans(rows)
        if not (penalty_rows or has_bias or allowed_rows or bans or token_masks is not None):
            return raw
        out = _host_copy(raw) if token_masks is not None else raw.clone()
        if token_masks is not None:
            token_masks.apply(out)
        guarded = sorted({r for r, _ in bans}.union(allowed_rows))
        before = out[guarded] if guarded else None  # (a copy: advanced indexing)
        if allowed_rows:
            keep_allowed_tokens(out, rows, allowed_rows)
        if penalty_rows:
            apply_penalties_to_rows(out, rows, penalty_rows)
        if has_bias:
            apply_logit_bias(out, rows)
        apply_bans(out, bans)
        if before is not None:
            dead = torch.isneginf(out[guarded]).all(dim=1)
            for j in dead.nonzero().flatten().tolist():
                out[guarded[j]] = before[j]
        return out

    def _sample_rows(
        self, processed: torch.Tensor, rows: Sequence[SamplingRow], greedy: list[bool]
    ) -> torch.Tensor:
        """Tokens for a batch with at least one sampled row: greedy rows by argmax, the others by
        temperature, filters and an inverse-CDF draw."""
        device = processed.device
        vocab_size = processed.shape[1]
        sampled = [i for i, g in enumerate(greedy) if not g]
        sub_rows = [rows[i] for i in sampled]
        sub_params = [r.params for r in sub_rows]
        if len(sampled) == len(rows):
            index = None
            logits = processed.clone()
        else:
            index = torch.tensor(sampled, dtype=torch.long, device=device)
            logits = processed.index_select(0, index)

        temperatures = [p.temperature for p in sub_params]
        if any(t != 1.0 for t in temperatures):
            logits.div_(torch.tensor(temperatures, dtype=torch.float32, device=device).unsqueeze(1))
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in sub_params]
        top_p = [p.top_p for p in sub_params]
        min_p = None
        if any(p.min_p > 0.0 for p in sub_params):
            min_p = torch.tensor([p.min_p for p in sub_params], dtype=torch.float32, device=device)
        u = self._uniforms(sub_rows, device)

        filtered = [j for j, (k, p) in enumerate(zip(top_k, top_p)) if k < vocab_size or p < 1.0]
        candidates = self.top_candidates if device.type == "cpu" else None
        if len(filtered) == len(sub_rows):
            picked = sample_top_k_top_p(logits, top_k, top_p, min_p, u, candidates)
        elif not filtered:
            picked = sample_plain(logits, min_p, u)
        else:
            # Rows without top-k/top-p skip the sort: split, draw each part, put back.
            in_filtered = set(filtered)
            plain = [j for j in range(len(sub_rows)) if j not in in_filtered]
            f_idx = torch.tensor(filtered, dtype=torch.long, device=device)
            p_idx = torch.tensor(plain, dtype=torch.long, device=device)
            picked = torch.empty(len(sub_rows), dtype=torch.long, device=device)
            picked[f_idx] = sample_top_k_top_p(
                logits.index_select(0, f_idx),
                [top_k[j] for j in filtered],
                [top_p[j] for j in filtered],
                None if min_p is None else min_p[f_idx],
                u[f_idx],
                candidates,
            )
            picked[p_idx] = sample_plain(
                logits.index_select(0, p_idx), None if min_p is None else min_p[p_idx], u[p_idx]
            )
        if index is None:
            return picked
        return argmax_rows(processed).index_copy_(0, index, picked)

    def _uniforms(self, rows: Sequence[SamplingRow], device: torch.device) -> torch.Tensor:
        """[n] float64 uniforms in [0, 1): seeded rows from their (seed, step), the rest from one
        batched draw of the engine generator."""
        u = torch.rand(len(rows), dtype=torch.float64, device=device, generator=self.generator)
        seeded = [(j, s) for j, s in enumerate(row_seed(r) for r in rows) if s is not None]
        if seeded:
            values = [seeded_uniform(s, rows[j].generated) for j, s in seeded]
            positions = torch.tensor([j for j, _ in seeded], dtype=torch.long, device=device)
            u.index_copy_(0, positions, torch.tensor(values, dtype=torch.float64, device=device))
        return u


__all__ = ["SampleResult", "Sampler", "mix_seed", "seeded_uniform"]
