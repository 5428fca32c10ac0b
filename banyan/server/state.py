"""What every HTTP handler shares: arguments, tokenizer side, engine client, metrics; and the
request checks common to all generation endpoints."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from banyan.args import EngineArgs
from banyan.sampling.params import SamplingParams
from banyan.server.args import ServerArgs
from banyan.server.engine_client import EngineClient, Stream
from banyan.server.errors import ApiError, bad_request, from_value_error
from banyan.server.ipc import EngineReady
from banyan.server.metrics import ServerMetrics
from banyan.server.protocol import _SamplingFields
from banyan.server.tokens import TokenizerSide


@dataclass(slots=True)
class ServerState:
    args: ServerArgs
    engine_args: EngineArgs
    model_name: str
    model_path: str
    tok: TokenizerSide
    client: EngineClient
    metrics: ServerMetrics
    sampling_defaults: dict[str, float] = field(default_factory=dict)  # generation_config.json
    started: float = field(default_factory=time.time)

    @property
    def engine(self) -> EngineReady:
        assert self.client.info is not None, "the engine is not ready"
        return self.client.info

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist; this server serves "
                                f"`{self.model_name}` (or leave `model` out).", "model")

    def check_n(self, n: int) -> None:
        if n > self.args.max_n:
            raise bad_request(f"n={n} is more than this server allows ({self.args.max_n})", "n")

    def max_new_tokens(self, prompt_len: int, requested: int | None, explicit: bool,
                       prompt_param: str = "prompt", tokens_param: str = "max_tokens") -> int:
        """Tokens to generate for a prompt: what was asked (refused with 400 when it cannot fit)
        or, for a default, as many as fit the context and the KV cache."""
        limit = self.engine.max_model_len
        if prompt_len >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your prompt "
                f"has {prompt_len} tokens (and at least one token must be generated). Please "
                f"reduce the length of the prompt.", prompt_param)
        capacity = self.engine.kv_capacity
        if prompt_len >= capacity:
            raise bad_request(f"the prompt of {prompt_len} tokens does not fit in the KV cache "
                              f"({capacity} tokens)", prompt_param)
        room = min(limit, capacity) - prompt_len
        if requested is None:
            return room
        if explicit and prompt_len + requested > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
                f"{requested} for the completion). Please reduce the length of the prompt or "
                f"the completion.", tokens_param)
        if explicit and prompt_len + requested > capacity:
            raise bad_request(
                f"the prompt ({prompt_len} tokens) plus max_tokens ({requested}) can never fit "
                f"in the KV cache ({capacity} tokens)", tokens_param)
        return min(requested, room)

    def prompt_room(self, requested: int | None) -> int:
        """The longest prompt that leaves `requested` new tokens (at least one) room in the
        context and the KV cache."""
        return min(self.engine.max_model_len, self.engine.kv_capacity) - max(1, requested or 0)

    def template_kwargs(self, kwargs: dict[str, Any] | None,
                        template: str | None = None) -> dict[str, Any] | None:
        """chat_template_kwargs as the template may see them, with vLLM's top-level
        `chat_template` among them: a template of the request's own only with
        --trust-request-chat-template (a template is code the server runs)."""
        for param, sent in (("chat_template", template is not None),
                            ("chat_template_kwargs", bool(kwargs) and "chat_template" in kwargs)):
            if sent and not self.args.trust_request_chat_template:
                raise bad_request("chat templates sent in requests are not accepted by this "
                                  "server (--trust-request-chat-template)", param)
        if template is not None:
            return {**(kwargs or {}), "chat_template": template}
        return kwargs

    def validate(self, params: SamplingParams) -> SamplingParams:
        try:
            params.validate(self.engine.vocab_size)
        except ValueError as exc:
            raise from_value_error(exc) from None
        return params


def check_ids(state: ServerState, ids: Iterable[int], param: str) -> list[int]:
    ids = list(ids)
    if not ids:
        raise bad_request("the prompt is empty: at least one token is needed", param)
    try:
        state.tok.check_ids(ids)
    except ValueError as exc:
        raise bad_request(str(exc), param) from None
    return ids


async def encode_text(state: ServerState, text: str, param: str,
                      add_special_tokens: bool = True) -> list[int]:
    """A text prompt's ids, tokenized off the event loop; 400 when it takes too long."""
    try:
        return await state.tok.encode_async(text, add_special_tokens)
    except ValueError as exc:
        raise bad_request(str(exc), param) from None


def prompt_ids(state: ServerState, body: _SamplingFields, ids: list[int], param: str,
               requested: int | None) -> list[int]:
    """A prompt's ids as the request leaves them (truncate_prompt_tokens), checked."""
    return check_ids(state, body.truncated(ids, state.prompt_room(requested)), param)


async def bad_words_ids(state: ServerState, words: list[str] | None) -> list[list[int]]:
    """A request's bad_words tokenized (off the event loop); 400 naming the field when one has
    no tokens."""
    if not words:
        return []
    try:
        return await state.tok.bad_words_ids_async(words)
    except ValueError as exc:
        raise bad_request(str(exc), "bad_words") from None


async def encode_chat(state: ServerState, messages: list[dict[str, Any]],
                      add_generation_prompt: bool, continue_final_message: bool = False,
                      template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """A conversation's ids (template rendered and tokenized off the event loop); 400 when the
    template refuses it or it takes too long. template_kwargs: as ServerState.template_kwargs
    returned them."""
    try:
        return await state.tok.chat_ids_async(messages, add_generation_prompt,
                                              continue_final_message, template_kwargs)
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from None


async def close_on_disconnect(request: Request, stream: Stream) -> None:
    """For a non-streamed response: the request body is read, so the next ASGI message can only
    be the disconnect. Close (abort) the stream the moment it comes."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            stream.close()
            return


async def collect(request: Request, stream: Stream, on_update: Callable[[int, Any], None]) -> None:
    watcher = asyncio.create_task(close_on_disconnect(request, stream))
    try:
        async for index, update in stream.events():
            on_update(index, update)
    finally:
        watcher.cancel()
        stream.close()


class SSEResponse(StreamingResponse):
    """Server-sent events that always release their engine requests: Starlette cancels the body
    iterator when the client goes away (and may never start it), so closing happens here."""

    def __init__(self, content: Any, on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
