"""Applies a step's sampled tokens to its requests and decides who is finished."""

from __future__ import annotations

from banyan.batch import TokenLogprobs
from banyan.scheduler.request import FinishReason, Request, RequestUpdate


def apply_tokens(req: Request, tokens: list[int], logprobs: list[TokenLogprobs],
                 max_model_len: int) -> RequestUpdate:
    """Append a step's tokens for one request (1..k+1 of them) in order, streaming their text,
    until one ends the request: the tokens after it are dropped (their KV slots are the
    caller's to hand back). Sets req.finish_reason; the caller releases the KV."""
    if len(tokens) == 1:  # the common case, once per running request per step: kept lean
        token = tokens[0]
        req.output_ids.append(token)
        if logprobs:
            req.logprobs.append(logprobs[0])
        text, reason = _push(req, token, max_model_len)
        return RequestUpdate(req.rid, tokens, text, reason, logprobs[:1],
                             len(req.prompt_ids), req.cached_tokens, None, [])
    appended: list[int] = []
    text_parts: list[str] = []
    reason: FinishReason | None = None
    for i, token in enumerate(tokens):
        req.output_ids.append(token)
        appended.append(token)
        if i < len(logprobs):
            req.logprobs.append(logprobs[i])
        text, reason = _push(req, token, max_model_len)
        text_parts.append(text)
        if reason is not None:
            break
    return RequestUpdate(req.rid, appended, "".join(text_parts), reason,
                         logprobs[: len(appended)], len(req.prompt_ids), req.cached_tokens)


def _push(req: Request, token: int, max_model_len: int) -> tuple[str, FinishReason | None]:
    """Stream one appended token's text and decide whether it ends the request (sets
    req.finish_reason)."""
    # A stop token, or a grammar that ended with this token (its stop token, taken even under
    # ignore_eos).
    stop_token = token in req.stop_ids or (req.grammar is not None
                                           and req.grammar.ends_with(len(req.output_ids)))
    text, stopped = "", False
    stream = req.text
    if stream is not None and not stop_token:
        text, stopped = stream.push_text(token)  # applies stop strings past min_new_tokens
    return decide_end(req, text, stopped, stop_token, max_model_len)


def decide_end(req: Request, text: str, stopped: bool, stop_token: bool,
               max_model_len: int) -> tuple[str, FinishReason | None]:
    """Whether the token just appended (and streamed: `text`, `stopped` by a stop string)
    ends the request; sets req.finish_reason and flushes held-back text when it does."""
    n_out = len(req.output_ids)
    # (stopped by text already respects min_new_tokens: the text stream knows it)
    if stopped or (stop_token and n_out >= req.params.min_new_tokens):
        reason: FinishReason | None = FinishReason.STOP
    elif n_out >= req.max_new_tokens or len(req.prompt_ids) + n_out >= max_model_len:
        reason = FinishReason.LENGTH
    else:
        req.finish_reason = None
        return text, None
    stream = req.text
    if stream is not None and not stopped:
        text += stream.finish()
    req.finish_reason = reason
    return text, reason


def add_prompt_logprobs(req: Request, position: int, entries: list[TokenLogprobs]) -> None:
    """Keep a step's prompt logprobs (scoring prompt tokens position+1...); positions already
    held (a retracted request recomputing its prompt) are not added twice."""
    have = len(req.prompt_logprobs)
    if position <= have:
        req.prompt_logprobs.extend(entries[have - position :])


def prompt_only_update(req: Request) -> RequestUpdate:
    """A max_new_tokens=0 request whose prompt was computed for its logprobs: the token sampled
    after the prompt is not kept; it ends with finish reason length."""
    req.finish_reason = FinishReason.LENGTH
    text = req.text.finish() if req.text is not None else ""
    return RequestUpdate(req.rid, [], text, FinishReason.LENGTH, [], len(req.prompt_ids),
                         req.cached_tokens, prompt_logprobs=req.prompt_logprobs)


def sampled_update(req: Request, tokens: list[int], logprobs: list[TokenLogprobs],
                   max_model_len: int) -> RequestUpdate:
    """What a step's sampled tokens make of a request that was still live: its tokens applied
    (the prompt's logprobs ride with its first ones), or its prompt logprobs alone when it was
    computed for nothing else (max_new_tokens=0)."""
    if req.max_new_tokens == 0:
        return prompt_only_update(req)
    update = apply_tokens(req, tokens, logprobs, max_model_len)
    if req.params.prompt_logprobs is not None and \
            len(req.output_ids) == len(update.new_token_ids):  # its first tokens
        update.prompt_logprobs = req.prompt_logprobs
    return update
