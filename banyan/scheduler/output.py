"""Applies a step's sampled tokens to its requests and decides who is finished."""

from __future__ import annotations

from banyan.batch import StepOutput
from banyan.scheduler.builder import ScheduledStep
from banyan.scheduler.request import FinishReason, Request, RequestUpdate


def is_stop_token(req: Request, token: int) -> bool:
    return token in req.params.stop_token_ids or (not req.params.ignore_eos and token in req.eos_ids)


def finish_reason_after(req: Request, stop_token: bool, stopped_by_text: bool,
                        max_model_len: int) -> FinishReason | None:
    """stopped_by_text already respects min_new_tokens (the text stream knows it)."""
    n_out = len(req.output_ids)
    if stopped_by_text or (stop_token and n_out >= req.params.min_new_tokens):
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
        stop_token = is_stop_token(req, token)
        if req.text is not None and not stop_token:
            delta = req.text.push(token)  # applies stop strings only past min_new_tokens
            text, stopped = delta.text, delta.stopped
        reason = finish_reason_after(req, stop_token, stopped, max_model_len)
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
