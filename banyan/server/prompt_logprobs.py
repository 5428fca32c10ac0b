"""Prompt logprobs on /v1/completions: which requests need them, and vLLM's `prompt_logprobs`
shape (OpenAI's legacy echo + logprobs shape is `CompletionLogprobs.prompt`).

Two ways to ask, both served by the engine computing logits at every prompt position:
- OpenAI's `echo: true` with `logprobs: k`: the echoed prompt tokens carry their logprobs (the
  first token's are null); with `max_tokens: 0` only the prompt comes back, which is what
  lm-evaluation-harness's `local-completions` loglikelihood requests send;
- vLLM's extra `prompt_logprobs: k`: each choice gets a `prompt_logprobs` list, null for the
  first token, then per token `{token_id: {"logprob", "rank", "decoded_token"}}` for the prompt
  token and its top-k alternatives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from banyan.batch import TokenLogprobs
from banyan.server.openai_format import lp
from banyan.server.protocol import CompletionRequest
from banyan.server.tokens import TokenizerSide


def wanted_prompt_logprobs(body: CompletionRequest) -> int | None:
    """Alternatives per prompt position the engine must compute (None: no prompt logprobs)."""
    wanted = [k for k in (body.prompt_logprobs,
                          body.logprobs if body.echo else None) if k is not None]
    return max(wanted) if wanted else None


def vllm_prompt_logprobs(tok: TokenizerSide, prompt_ids: Sequence[int],
                         entries: Sequence[TokenLogprobs]) -> list[dict[str, Any] | None]:
    out: list[dict[str, Any] | None] = [None] if prompt_ids else []
    for e in entries:
        position: dict[str, Any] = {}
        for rank, (t, v) in enumerate(zip(e.top_ids, e.top_logprobs, strict=True), start=1):
            position[str(t)] = {"logprob": lp(v), "rank": rank, "decoded_token": tok.token_text(t)}
        # the prompt token itself, with its own rank, whether or not it is among the top k
        position[str(e.token_id)] = {"logprob": lp(e.logprob), "rank": e.rank,
                                     "decoded_token": tok.token_text(e.token_id)}
        out.append(position)
    return out
