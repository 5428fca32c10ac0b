"""Applies a step's sampled tokens to its requests and decides who is finished."""

from __future__ import annotations

from banyan.batch import StepOutput
from banyan.scheduler.builder import ScheduledStep
from banyan.scheduler.request import FinishReason, Request, RequestUpdate


def finish_reason_after(req: Request, token: int, stopped_by_text: bool, max_model_len: int) -> FinishReason | None:
    n_out = len(req.output_ids)
    params = req.params
    if n_out >= params.min_new_tokens:
        if token in params.stop_token_ids or (not params.ignore_eos and token in req.eos_ids):
            return FinishReason.STOP
        if stopped_by_text:
            return FinishReason.STOP
    if n_out >= req.max_new_tokens or req.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None


def apply_step(step: ScheduledStep, out: StepOutput, max_model_len: int) -> list[RequestUpdate]:
    """Append each sampled token, stream its text, and mark finished requests (their KV is
    released by the caller)."""
    updates: list[RequestUpdate] = []
    for req, token, logprob in zip(step.sampled, out.next_tokens, out.logprobs, strict=True):
        req.output_ids.append(token)
        if logprob is not None:
            req.logprobs.append(logprob)
        text, stopped = "", False
        is_stop_token = token in req.params.stop_token_ids or (
            not req.params.ignore_eos and token in req.eos_ids
        )
        if req.text is not None and not is_stop_token:
            delta = req.text.push(token)
            text, stopped = delta.text, delta.stopped
            # Stop strings only count once min_new_tokens is reached (the sampler cannot block
            # them the way it blocks stop tokens).
            stopped = stopped and len(req.output_ids) >= req.params.min_new_tokens
        reason = finish_reason_after(req, token, stopped, max_model_len)
        if reason is not None:
            req.finish_reason = reason
            if req.text is not None and not stopped:
                text += req.text.finish()
        updates.append(
            RequestUpdate(
                rid=req.rid,
                new_token_ids=[token],
                text=text,
                finish_reason=reason,
                logprobs=[logprob] if logprob is not None else [],
                prompt_tokens=len(req.prompt_ids),
                cached_tokens=req.cached_tokens,
            )
        )
    return updates
