"""Log-probabilities returned to the user.

They are the log_softmax of the raw model logits, before penalties, logit bias, temperature and
top-k/top-p/min-p filtering (vLLM's default "raw_logprobs"): they describe what the model thinks,
are the same whatever sampling knobs a request turns, and never come out as -inf for a token the
filters removed. The chosen token's logprob is taken from the same distribution, so it equals the
matching entry of the top-k list when the chosen token is among them.
"""

from __future__ import annotations

import torch

from banyan.batch import TokenLogprobs


def compute_logprobs(
    raw_logits: torch.Tensor,
    row_indices: list[int],
    top_ks: list[int],
    next_tokens: torch.Tensor,
) -> list[TokenLogprobs]:
    """For each batch row in `row_indices` (asking for `top_ks[j]` alternatives), the chosen
    token's logprob and the top-k alternatives sorted by decreasing logprob.

    raw_logits: [B, V]; next_tokens: [B] long, on the same device.
    """
    if len(row_indices) == raw_logits.shape[0]:
        logits, chosen = raw_logits, next_tokens
    else:
        index = torch.tensor(row_indices, dtype=torch.long, device=raw_logits.device)
        logits, chosen = raw_logits.index_select(0, index), next_tokens.index_select(0, index)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)
    max_k = min(max(top_ks), logprobs.shape[1])
    # One device-to-host transfer per tensor, not one per row.
    chosen_ids = chosen.tolist()
    chosen_values = chosen_lp.tolist()
    if max_k > 0:
        top_values, top_ids = logprobs.topk(max_k, dim=-1, sorted=True)
        top_values_list, top_ids_list = top_values.tolist(), top_ids.tolist()
    out: list[TokenLogprobs] = []
    for j, k in enumerate(top_ks):
        entry = TokenLogprobs(token_id=chosen_ids[j], logprob=chosen_values[j])
        if k > 0:
            entry.top_ids = top_ids_list[j][:k]
            entry.top_logprobs = top_values_list[j][:k]
        out.append(entry)
    return out
