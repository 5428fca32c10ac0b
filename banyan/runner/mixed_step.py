"""A step that mixes decodes and speculative checks (up to native.EXACT_STEP_TOKENS new tokens
in all) with prefill chunks runs as two forwards, the decodes and checks first.

Why: the kernels pick their arithmetic by the step's token count. Up to EXACT_STEP_TOKENS a
token's bits are those it has alone (tested kernel by kernel); past it the linears take GEMMs
(a quantized weight rounded to bf16, oneDNN, torch's float32 GEMM), which give other last bits.
A decode that shared its step with a prefill chunk was computed by the GEMM, the same decode in
a step of decodes by the short kernels: with speculation on, which tokens of a request fall in
a mixed step changes (its check may, where its decode would not), and bf16 rounding turns the
last-bit difference into a flipped near-tie soon (10 requests after one long prefix, the default
GGUF model, draft speculation: one parted at its 40th token). Run apart, a short request's
tokens get the short kernels whatever else the scheduler put in the step. The price: the short
part reads the weights once more, about a decode step's time, in steps that also prefill.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from banyan.batch import ForwardBatch
from banyan.kernels.native import EXACT_STEP_TOKENS


@dataclass(slots=True)
class MixedSplit:
    """The two parts of a mixed step and how their outputs go back into the step's order."""

    short: ForwardBatch
    long: ForwardBatch
    # For each logit row of the whole step, in its order: its index among the short part's
    # logit rows followed by the long part's.
    logit_order: list[int]
    # The same for the prompt-logprob spans (ForwardBatch.prompt_logprobs).
    prompt_order: list[int]


def split_mixed_step(batch: ForwardBatch,
                     short_tokens: int = EXACT_STEP_TOKENS) -> MixedSplit | None:
    """The step's decodes and checks (sampling requests whose new tokens are their last token
    and its proposals) apart from its prefill chunks, or None when it has not both, when the
    whole step is `short_tokens` tokens or fewer (its short kernels take it whole), or when its
    decodes and checks are more than that (then they take the long kernels however they run: a
    step of that many decodes does too)."""
    if batch.num_tokens <= short_tokens or batch.num_tokens == batch.batch_size:
        return None  # (the usual steps, answered without a loop over the batch)
    proposed = batch.proposed or [[] for _ in batch.sample_indices]
    is_short = [False] * batch.batch_size
    for i, guess in zip(batch.sample_indices, proposed, strict=True):
        is_short[i] = batch.extend_lens[i] == len(guess) + 1
    short = [i for i in range(batch.batch_size) if is_short[i]]
    if not short or len(short) == batch.batch_size:
        return None
    if sum(batch.extend_lens[i] for i in short) > short_tokens:
        return None
    long = [i for i in range(batch.batch_size) if not is_short[i]]
    starts, at = [], 0  # each request's first flat token
    for n in batch.extend_lens:
        starts.append(at)
        at += n
    parts = (_part(batch, starts, short, True), _part(batch, starts, long, False))
    logit_order = _merge_order([(is_short[i], len(guess) + 1)
                                for i, guess in zip(batch.sample_indices, proposed, strict=True)])
    prompt_order = _merge_order([(is_short[s.index], 1) for s in batch.prompt_logprobs])
    return MixedSplit(parts[0], parts[1], logit_order, prompt_order)


def _merge_order(entries: list[tuple[bool, int]]) -> list[int]:
    """Entries of the whole step, each (in the short part, its rows) -> for each row in step
    order, its index in the short part's rows followed by the long part's."""
    short_rows = sum(rows for in_short, rows in entries if in_short)
    taken = [0, short_rows]  # next row of the short part, of the long part
    order: list[int] = []
    for in_short, rows in entries:
        part = 0 if in_short else 1
        order += range(taken[part], taken[part] + rows)
        taken[part] += rows
    return order


def _part(batch: ForwardBatch, starts: list[int], members: list[int],
          first: bool) -> ForwardBatch:
    """The sub-step of batch entries `members` (in order; starts: each entry's first flat
    token); the first part written also takes the step's prefix-cache hits (table writes:
    order does not matter, both are prepared before either runs)."""
    index = {i: k for k, i in enumerate(members)}
    part = ForwardBatch(
        rows=[batch.rows[i] for i in members],
        prefix_lens=[batch.prefix_lens[i] for i in members],
        extend_lens=[batch.extend_lens[i] for i in members],
        row_prefixes=list(batch.row_prefixes) if first else [],
        max_shared_prefix=batch.max_shared_prefix)
    flat: dict[int, int] = {}  # the step's flat token index -> the part's
    for i in members:
        for t in range(starts[i], starts[i] + batch.extend_lens[i]):
            flat[t] = len(part.input_ids)
            part.input_ids.append(batch.input_ids[t])
            part.out_slots.append(batch.out_slots[t])
    for j, i in enumerate(batch.sample_indices):
        if i in index:
            part.sample_indices.append(index[i])
            if batch.sampling:  # (the runner alone needs none: tests, benchmarks)
                part.sampling.append(batch.sampling[j])
            if batch.proposed:
                part.proposed.append(batch.proposed[j])
    part.deferred_inputs = [flat[t] for t in batch.deferred_inputs if t in flat]
    part.prompt_logprobs = [dataclasses.replace(s, index=index[s.index])
                            for s in batch.prompt_logprobs if s.index in index]
    return part
