"""OpenAI response shapes: choices, logprobs, usage, SSE events.

Plain dicts, encoded with msgspec (fast, UTF-8, no NaN/inf: logprobs are clamped first).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from banyan.batch import TokenLogprobs
from banyan.server.errors import error_body
from banyan.server.ipc import Update
from banyan.server.tokens import TokenizerSide

MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM's clamp
DONE = "data: [DONE]\n\n"
_encoder = msgspec.json.Encoder()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def sse(obj: dict[str, Any]) -> str:
    return "data: " + _encoder.encode(obj).decode("utf-8") + "\n\n"


def sse_error(status: int, message: str) -> str:
    return sse(error_body(status, message))


def lp(x: float) -> float:
    """A logprob JSON can carry: -inf (and NaN, which compares false) become MIN_LOGPROB."""
    return x if x >= MIN_LOGPROB else MIN_LOGPROB


@dataclass(slots=True)
class ChoiceState:
    """One choice accumulated from its updates."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)

    def add(self, update: Update) -> None:
        if update.prompt_logprobs:
            self.prompt_logprobs = update.prompt_logprobs
        self.text.append(update.text)
        self.token_ids.extend(update.token_ids)
        self.logprobs.extend(update.logprobs)
        self.cached_tokens = max(self.cached_tokens, update.cached_tokens)
        if update.finish_reason is not None:
            self.finish_reason = update.finish_reason
            self.error = update.error

    @property
    def full_text(self) -> str:
        return "".join(self.text)


def usage(prompt_lens: Sequence[int], choices: Sequence[ChoiceState], n: int) -> dict[str, Any]:
    """Prompt tokens count once per prompt (not per sample); cached tokens are, per prompt, the
    most any of its samples got from the prefix cache (the offline Engine's rule)."""
    prompt = sum(prompt_lens)
    completion = sum(len(c.token_ids) for c in choices)
    cached = sum(max((c.cached_tokens for c in choices[p * n:(p + 1) * n]), default=0)
                 for p in range(len(prompt_lens)))
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


# ---- logprobs --------------------------------------------------------------------------------


class CompletionLogprobs:
    """Legacy completions logprobs: parallel lists, built incrementally (stream deltas carry
    their own slice, with text offsets continuing from the previous ones)."""

    def __init__(self, tok: TokenizerSide, offset: int = 0, as_ids: bool = False) -> None:
        self.tok = tok
        self.offset = offset
        self.as_ids = as_ids  # return_tokens_as_token_ids (text offsets stay the text's)

    def _name(self, token_id: int) -> str:
        return token_id_name(token_id) if self.as_ids else self.tok.token_text(token_id)

    def prompt(self, ids: Sequence[int], entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
        """Echoed prompt tokens with their logprobs (entries[i] scores token i + 1, computed by
        the engine): the first token has nothing before it, so its values are null (as in
        OpenAI's answers)."""
        out = self._empty()
        if ids:
            out["tokens"].append(self._name(ids[0]))
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            out["text_offset"].append(self.offset)
            self.offset += len(self.tok.token_text(ids[0]))
        return self.merge(out, self.output(entries))

    def output(self, entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
        out = self._empty()
        for e in entries:
            name = self._name(e.token_id)
            # Keyed by text, so distinct tokens can collide (e.g. byte tokens that all decode
            # to U+FFFD): the first, most likely one keeps the key (as_ids: none collide).
            # OpenAI also lists the sampled token when it is not among the top k.
            top: dict[str, float] = {}
            for t, v in zip(e.top_ids, e.top_logprobs):
                top.setdefault(self._name(t), lp(v))
            top.setdefault(name, lp(e.logprob))
            out["tokens"].append(name)
            out["token_logprobs"].append(lp(e.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(self.tok.token_text(e.token_id))
        return out

    @staticmethod
    def _empty() -> dict[str, list[Any]]:
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    @staticmethod
    def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        return {k: a[k] + b[k] for k in a}


def token_id_name(token_id: int) -> str:
    """vLLM's return_tokens_as_token_ids: a token named by its id, which any JSON can carry."""
    return f"token_id:{token_id}"


def chat_logprobs(tok: TokenizerSide, entries: Sequence[TokenLogprobs],
                  as_ids: bool = False) -> list[dict[str, Any]]:
    def token(t: int) -> tuple[str, list[int]]:
        if as_ids:  # (its bytes: the name's, as vLLM gives them)
            return token_id_name(t), list(token_id_name(t).encode())
        return tok.token(t)

    content = []
    for e in entries:
        text, raw = token(e.token_id)
        top = []
        for t, v in zip(e.top_ids, e.top_logprobs):
            t_text, t_raw = token(t)
            top.append({"token": t_text, "logprob": lp(v), "bytes": t_raw})
        content.append({"token": text, "logprob": lp(e.logprob), "bytes": raw,
                        "top_logprobs": top})
    return content


# ---- whole responses -------------------------------------------------------------------------


def completion_response(rid: str, created: int, model: str, choices: list[dict[str, Any]],
                        usage_: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage_}


def chat_response(rid: str, created: int, model: str, choices: list[dict[str, Any]],
                  usage_: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage_}


def chunk(rid: str, obj: str, created: int, model: str, choices: list[dict[str, Any]],
          with_usage_field: bool, usage_so_far: tuple[int, int] | None = None) -> dict[str, Any]:
    """One stream chunk. With include_usage OpenAI sends `"usage": null` on every chunk but the
    last; without it the key is absent. usage_so_far: (prompt, completion) tokens of the
    chunk's choice (vLLM's continuous_usage_stats) in place of the null."""
    out: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model,
                           "choices": choices}
    if usage_so_far is not None:
        prompt, done = usage_so_far
        out["usage"] = {"prompt_tokens": prompt, "completion_tokens": done,
                        "total_tokens": prompt + done}
    elif with_usage_field:
        out["usage"] = None
    return out


def usage_chunk(rid: str, obj: str, created: int, model: str,
                usage_: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage_}
