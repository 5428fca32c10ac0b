"""POST /v1/responses: OpenAI's Responses API over the chat path (one assistant message of text).

Input is a string (one user message) or a list of messages (`{"role", "content"}`, with or
without `"type": "message"`; content a string or `input_text`/`output_text` parts);
`instructions` becomes a system message before them. The reply is one `message` output item
with one `output_text` part. Streamed, it is the event sequence the openai client's
`responses.create(stream=True)` consumes: response.created, response.in_progress,
response.output_item.added, response.content_part.added, response.output_text.delta...,
response.output_text.done, response.content_part.done, response.output_item.done, then
response.completed (or response.incomplete when max_output_tokens cut it), each as an SSE
`event:` + `data:` pair with a growing sequence_number, and no `[DONE]` (OpenAI sends none).

Not served (a 400 naming the field, never silently ignored): tools, previous_response_id
(nothing is stored), non-text input parts, text.format other than plain text.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from pydantic import ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from banyan.server.engine_client import EngineDeadError, EngineRequest, RequestRejected, Stream
from banyan.server.errors import ApiError, bad_request, engine_dead, from_value_error, read_body
from banyan.server.openai_format import ChoiceState, new_id, now_s
from banyan.server.protocol import INT64_MAX, _SamplingFields
from banyan.server.state import (ServerState, SSEResponse, bad_words_ids, collect, encode_chat,
                                 prompt_ids)

logger = logging.getLogger(__name__)

TEXT_PART_TYPES = frozenset({"input_text", "output_text", "text"})


class ResponsesRequest(_SamplingFields):
    # Items and parts carry fields we do not read (ids, annotations, status): allowed through.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    tools: list[dict[str, Any]] | None = None
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None

    def messages(self) -> list[dict[str, Any]]:
        """The conversation for the chat template; ValueError naming what is not supported."""
        out: list[dict[str, Any]] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            role = item.get("role")
            if kind != "message" or not isinstance(role, str) or not role:
                raise ValueError(f"input[{i}]: only messages with a role are supported "
                                 f"(got type {kind!r})")
            out.append({"role": role, "content": _text_of(item.get("content"), i)})
        if not out:
            raise ValueError("input must hold at least one message")
        return out


def _text_of(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"input[{i}].content must be a string or a list of text parts")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in TEXT_PART_TYPES \
                or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"input[{i}].content: parts of type {kind!r} are not supported "
                             "(text only)")
        texts.append(part["text"])
    return "".join(texts)


class ResponsesServing:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def create(self, request: Request) -> Response:
        st = self.state
        body: ResponsesRequest = await read_body(request, ResponsesRequest,
                                                 st.args.max_request_bytes,
                                                 st.args.request_body_timeout)
        st.check_model(body.model)
        _refuse_unsupported(body)
        try:
            messages = body.messages()
        except ValueError as exc:
            raise bad_request(str(exc), "input") from None
        requested = body.max_output_tokens
        ids = prompt_ids(st, body, await encode_chat(st, messages, True), "input", requested)
        max_new = st.max_new_tokens(len(ids), requested, requested is not None, "input",
                                    "max_output_tokens")
        params = body.sampling_params(max_new, None, st.sampling_defaults)
        params.bad_words_ids = await bad_words_ids(st, body.bad_words)
        params = st.validate(params)
        rid = new_id("resp")
        try:
            stream = st.client.submit([EngineRequest(rid, ids, params, body.cache_salt)])
        except EngineDeadError:
            raise engine_dead() from None
        except RequestRejected as exc:
            raise bad_request(str(exc)) from None
        shape = _Shape(rid, new_id("msg"), now_s(), st.model_name, body, len(ids))
        if body.stream:
            return SSEResponse(self._stream(shape, stream), stream.close)
        state = ChoiceState()
        try:
            await collect(request, stream, lambda _i, u: state.add(u))
        except EngineDeadError:
            raise engine_dead() from None
        except RequestRejected as exc:
            raise from_value_error(exc) from None
        if state.error:
            raise ApiError(500, state.error)
        return JSONResponse(shape.response(state))

    async def _stream(self, shape: _Shape, stream: Stream) -> AsyncIterator[str]:
        seq = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal seq
            seq += 1
            return _sse(kind, {"type": kind, "sequence_number": seq - 1, **fields})

        state = ChoiceState()
        ids = {"item_id": shape.item_id, "output_index": 0, "content_index": 0}
        try:
            yield event("response.created", response=shape.response(None))
            yield event("response.in_progress", response=shape.response(None))
            yield event("response.output_item.added", output_index=0,
                        item=shape.message("", "in_progress"))
            yield event("response.content_part.added", **ids, part=_text_part(""))
            async for _index, update in stream.events():
                state.add(update)
                if update.error:
                    raise ApiError(500, update.error)
                if update.text:
                    yield event("response.output_text.delta", **ids, delta=update.text,
                                logprobs=[])
            text = state.full_text
            yield event("response.output_text.done", **ids, text=text, logprobs=[])
            yield event("response.content_part.done", **ids, part=_text_part(text))
            final = shape.response(state)
            yield event("response.output_item.done", output_index=0, item=final["output"][0])
            yield event(f"response.{final['status']}", response=final)
        except EngineDeadError:
            yield event("error", code="503", message=engine_dead().message, param=None)
        except RequestRejected as exc:
            err = from_value_error(exc)
            yield event("error", code=str(err.status), message=err.message, param=None)
        except ApiError as exc:
            yield event("error", code=str(exc.status), message=exc.message, param=None)
        except Exception as exc:  # noqa: BLE001 - the stream must end properly
            logger.exception("responses stream %s failed", shape.id)
            yield event("error", code="500", message=f"internal error: {exc}", param=None)
        finally:
            stream.close()


class _Shape:
    """The parts of one Response object that do not change while it is generated."""

    def __init__(self, rid: str, item_id: str, created: int, model: str,
                 body: ResponsesRequest, prompt_tokens: int) -> None:
        self.id, self.item_id, self.created, self.model = rid, item_id, created, model
        self.body = body
        self.prompt_tokens = prompt_tokens

    def message(self, text: str, status: str) -> dict[str, Any]:
        """The output message item; an item in progress has no content part yet."""
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant",
                "content": [] if status == "in_progress" else [_text_part(text)]}

    def response(self, state: ChoiceState | None) -> dict[str, Any]:
        """The Response object: in progress (state None) or finished."""
        b = self.body
        out: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model,
            "status": "in_progress", "error": None, "incomplete_details": None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "temperature": b.temperature, "top_p": b.top_p, "output": [],
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "metadata": {},
            "previous_response_id": None, "reasoning": None, "store": False, "usage": None,
            "user": b.user,
        }
        if state is None:
            return out
        cut = state.finish_reason == "length"
        out["status"] = "incomplete" if cut else "completed"
        if cut:
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        out["output"] = [self.message(state.full_text, "incomplete" if cut else "completed")]
        completion = len(state.token_ids)
        out["usage"] = {
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": {"cached_tokens": state.cached_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.prompt_tokens + completion,
        }
        return out


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _sse(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {msgspec.json.encode(data).decode()}\n\n"


def _refuse_unsupported(body: ResponsesRequest) -> None:
    if body.n != 1:
        raise bad_request("n is not supported on /v1/responses", "n")
    if body.tools:
        raise bad_request("tools are not supported on /v1/responses", "tools")
    for name in ("return_token_ids", "return_tokens_as_token_ids"):  # (chat and completions)
        if getattr(body, name):
            raise bad_request(f"{name} is not supported on /v1/responses", name)
    if body.previous_response_id is not None:
        raise bad_request("previous_response_id is not supported: responses are not stored",
                          "previous_response_id")
    fmt = (body.text or {}).get("format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise bad_request("text.format other than {\"type\": \"text\"} is not supported on "
                          "/v1/responses", "text")
