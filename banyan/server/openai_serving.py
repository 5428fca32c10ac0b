"""POST /v1/completions and /v1/chat/completions: prompts in, engine requests out, and the
engine's updates turned into OpenAI responses or SSE streams."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from banyan.batch import TokenLogprobs
from banyan.server.engine_client import EngineDeadError, EngineRequest, RequestRejected, Stream
from banyan.server.errors import ApiError, bad_request, engine_dead, from_value_error, read_body
from banyan.server.ipc import Update
from banyan.server.openai_format import (
    DONE,
    ChoiceState,
    CompletionLogprobs,
    chat_logprobs,
    chat_response,
    chunk,
    completion_response,
    new_id,
    now_s,
    sse,
    sse_error,
    usage,
    usage_chunk,
)
from banyan.server.prompt_logprobs import vllm_prompt_logprobs, wanted_prompt_logprobs
from banyan.server.protocol import ChatCompletionRequest, CompletionRequest
from banyan.server.structured_api import ChatTools, ToolDeltas, structured_spec
from banyan.server.state import (
    ServerState,
    SSEResponse,
    bad_words_ids,
    prompt_ids,
    collect,
    encode_chat,
    encode_text,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Job:
    """One API request in flight: what the response builders need to know about it."""

    id: str
    created: int
    model: str
    prompts: list[list[int]]
    echo_texts: list[str]  # per prompt, when echo
    n: int
    stream: Stream
    include_usage: bool
    logprobs: int | None  # completions: k; chat: top_logprobs when logprobs=true
    tools: bool = False  # chat with tools: output parsed for tool calls
    token_ids: bool = False  # return_token_ids
    ids_as_names: bool = False  # return_tokens_as_token_ids: logprobs name tokens by id
    continuous_usage: bool = False  # stream_options.continuous_usage_stats

    def usage_so_far(self, index: int, states: list[ChoiceState]) -> tuple[int, int] | None:
        """A chunk's (prompt, completion) tokens where continuous usage was asked."""
        if not self.continuous_usage:
            return None
        return len(self.prompts[index // self.n]), len(states[index].token_ids)

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n


class OpenAIServing:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    # ---- completions -------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        st = self.state
        body: CompletionRequest = await read_body(request, CompletionRequest,
                                                  st.args.max_request_bytes,
                                                  st.args.request_body_timeout)
        st.check_model(body.model)
        st.check_n(body.n)
        _check_stream_options(body.stream, body.stream_options is not None)
        if body.suffix:
            raise bad_request("suffix is not supported", "suffix")
        raw = body.prompts()
        if not raw:
            raise bad_request("prompt must not be empty", "prompt")
        if len(raw) > st.args.max_prompts:
            raise bad_request(f"{len(raw)} prompts in one request; the limit is "
                              f"{st.args.max_prompts}", "prompt")
        prompts: list[list[int]] = []
        echo_texts: list[str] = []
        explicit = "max_tokens" in body.model_fields_set and body.max_tokens is not None
        for p in raw:
            ids = await encode_text(st, p, "prompt") if isinstance(p, str) else p
            kept = prompt_ids(st, body, ids, "prompt", body.max_tokens)  # (16 when unsaid)
            prompts.append(kept)
            if not body.echo or (isinstance(p, str) and len(kept) == len(ids)):
                echo_texts.append(p if isinstance(p, str) else "")
            else:  # token ids, or a text cut by truncate_prompt_tokens: what the model saw
                echo_texts.append(await st.tok.decode_async(kept, skip_special_tokens=False))
        requests = []
        job_id = new_id("cmpl")
        structured = structured_spec(body)
        bad_words = await bad_words_ids(st, body.bad_words)
        for i, ids in enumerate(prompts):
            max_new = st.max_new_tokens(len(ids), body.max_tokens, explicit)
            params = body.sampling_params(max_new, body.logprobs, st.sampling_defaults)
            params.bad_words_ids = bad_words
            params.prompt_logprobs = wanted_prompt_logprobs(body)
            params.structured = structured
            params = st.validate(params)
            requests.append(EngineRequest(f"{job_id}-{i}", ids, params, body.cache_salt,
                                          body.kv_source))
        job = _Job(job_id, now_s(), st.model_name, prompts, echo_texts if body.echo else [],
                   body.n, self._submit(requests), body.include_usage, body.logprobs,
                   token_ids=body.return_token_ids,
                   ids_as_names=body.return_tokens_as_token_ids,
                   continuous_usage=body.continuous_usage)
        if body.stream:
            return SSEResponse(self._stream_completion(job), job.stream.close)
        states = await self._collect(request, job)
        choices = []
        for i, s in enumerate(states):
            p = i // job.n
            logprobs = None
            if job.logprobs is not None:
                log = CompletionLogprobs(st.tok, as_ids=job.ids_as_names)
                head = log.prompt(prompts[p], s.prompt_logprobs) if body.echo else None
                logprobs = log.output(s.logprobs)
                if head is not None:
                    logprobs = CompletionLogprobs.merge(head, logprobs)
            text = (job.echo_texts[p] if body.echo else "") + s.full_text
            choice = {"index": i, "text": text, "logprobs": logprobs,
                      "finish_reason": s.finish_reason}
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(st.tok, prompts[p],
                                                                 s.prompt_logprobs)
            if job.token_ids:
                choice.update(prompt_token_ids=prompts[p], token_ids=s.token_ids)
            choices.append(choice)
        return JSONResponse(completion_response(job.id, job.created, job.model, choices,
                                                usage([len(p) for p in prompts], states, job.n)))

    async def _stream_completion(self, job: _Job) -> AsyncIterator[str]:
        obj = "text_completion"
        logs = ([CompletionLogprobs(self.state.tok, as_ids=job.ids_as_names)
                 for _ in range(job.num_choices)]
                if job.logprobs is not None else None)

        first = [True] * job.num_choices  # (return_token_ids: the prompt's ids go with it)

        def event(index: int, text: str, logprobs: Any, finish: str | None,
                  states: list[ChoiceState], ids: list[int] | None = None) -> str:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            if job.token_ids:
                if first[index]:
                    first[index] = False
                    choice["prompt_token_ids"] = job.prompts[index // job.n]
                choice["token_ids"] = ids or []
            return sse(chunk(job.id, obj, job.created, job.model, [choice], job.include_usage,
                             job.usage_so_far(index, states)))

        def echo(i: int, prompt_logprobs: list[TokenLogprobs], states: list[ChoiceState]) -> str:
            p = i // job.n
            return event(i, job.echo_texts[p],
                         logs[i].prompt(job.prompts[p], prompt_logprobs) if logs else None, None,
                         states)

        async def body(states: list[ChoiceState]) -> AsyncIterator[str]:
            # With logprobs the echo waits for the prompt's logprobs (they come with the first
            # token); without, it goes out at once.
            echo_waits = bool(job.echo_texts) and logs is not None
            if job.echo_texts and not echo_waits:
                for i in range(job.num_choices):
                    yield echo(i, [], states)
            echoed = [not echo_waits] * job.num_choices
            async for index, update in job.stream.events():
                states[index].add(update)
                _raise_update_error(update)
                if not echoed[index]:
                    echoed[index] = True
                    yield echo(index, update.prompt_logprobs, states)
                if update.text or update.logprobs or update.finish_reason is not None \
                        or (job.token_ids and update.token_ids):
                    yield event(index, update.text,
                                logs[index].output(update.logprobs) if logs else None,
                                update.finish_reason, states, update.token_ids)

        async for text in self._sse(job, obj, body):
            yield text

    # ---- chat --------------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        st = self.state
        body: ChatCompletionRequest = await read_body(request, ChatCompletionRequest,
                                                      st.args.max_request_bytes,
                                                      st.args.request_body_timeout)
        st.check_model(body.model)
        st.check_n(body.n)
        _check_stream_options(body.stream, body.stream_options is not None)
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        try:
            messages = [m.template_dict() for m in body.messages]
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from None
        template_kwargs = st.template_kwargs(body.chat_template_kwargs, body.chat_template)
        tools = ChatTools.from_body(body.tools, body.tool_choice, st.args.tool_call_parser)
        if tools is not None:
            template = ((template_kwargs or {}).get("chat_template")
                        or getattr(st.tok.tokenizer, "chat_template", None))
            messages, template_kwargs = tools.render(messages, template, template_kwargs)
        ids = await encode_chat(st, messages, body.add_generation_prompt,
                                body.continue_final_message, template_kwargs)
        requested = body.requested_max_tokens
        ids = prompt_ids(st, body, ids, "messages", requested)
        max_new = st.max_new_tokens(
            len(ids), requested, requested is not None, "messages",
            "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens")
        k = (body.top_logprobs or 0) if body.logprobs else None
        params = body.sampling_params(max_new, k, st.sampling_defaults)
        params.bad_words_ids = await bad_words_ids(st, body.bad_words)
        params.structured = structured_spec(body)
        if tools is not None and tools.forced is not None:
            if params.structured is not None:
                raise bad_request("response_format cannot be combined with a forced tool_choice",
                                  "tool_choice")
            params.structured = tools.forced
        params = st.validate(params)
        job_id = new_id("chatcmpl")
        job = _Job(job_id, now_s(), st.model_name, [ids], [], body.n,
                   self._submit([EngineRequest(job_id, ids, params, body.cache_salt,
                                               body.kv_source)]),
                   body.include_usage, k, tools is not None, body.return_token_ids,
                   body.return_tokens_as_token_ids, body.continuous_usage)
        if body.stream:
            return SSEResponse(self._stream_chat(job), job.stream.close)
        states = await self._collect(request, job)
        choices = []
        for i, s in enumerate(states):
            message: dict[str, Any] = {"role": "assistant", "content": s.full_text}
            finish = s.finish_reason
            if tools is not None:
                message, finish = ChatTools.message(s.full_text, finish)
            choices.append({"index": i, "message": message,
                            "logprobs": ({"content": chat_logprobs(st.tok, s.logprobs,
                                                                   job.ids_as_names)}
                                         if k is not None else None),
                            "finish_reason": finish,
                            **({"token_ids": s.token_ids} if job.token_ids else {})})
        out = chat_response(job.id, job.created, job.model, choices,
                            usage([len(ids)], states, job.n))
        if job.token_ids:
            out["prompt_token_ids"] = ids
        return JSONResponse(out)

    async def _stream_chat(self, job: _Job) -> AsyncIterator[str]:
        obj = "chat.completion.chunk"
        tok = self.state.tok

        def event(index: int, delta: dict[str, Any], logprobs: Any, finish: str | None,
                  states: list[ChoiceState], ids: list[int] | None = None) -> str:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            out = chunk(job.id, obj, job.created, job.model, [choice], job.include_usage,
                        job.usage_so_far(index, states))
            if job.token_ids:  # (the prompt's ids with a choice's first chunk, its role's)
                choice["token_ids"] = ids or []
                if "role" in delta:
                    out["prompt_token_ids"] = job.prompts[0]
            return sse(out)

        tool_deltas = ToolDeltas(job.num_choices) if job.tools else None

        async def body(states: list[ChoiceState]) -> AsyncIterator[str]:
            # The role chunk goes out right before a choice's first token, as vLLM's does, not
            # at submit time: clients (vllm bench serve) start their TTFT clock at the first
            # chunk, so an early one reports the queueing and prefill as "after first token".
            role_sent = [False] * job.num_choices
            async for index, update in job.stream.events():
                states[index].add(update)
                _raise_update_error(update)
                if not role_sent[index]:
                    role_sent[index] = True
                    yield event(index, {"role": "assistant", "content": ""}, None, None, states)
                if update.text or update.logprobs or update.finish_reason is not None \
                        or (job.token_ids and update.token_ids):
                    logprobs = ({"content": chat_logprobs(tok, update.logprobs,
                                                          job.ids_as_names)}
                                if job.logprobs is not None else None)
                    delta = {"content": update.text} if update.text else {}
                    finish = update.finish_reason
                    if tool_deltas is not None:  # content and tool calls, then the finish
                        deltas, finish = tool_deltas.deltas(index, update.text, finish)
                        for d in deltas[:-1]:
                            yield event(index, d, None, None, states)
                        delta = deltas[-1] if deltas else {}
                    yield event(index, delta, logprobs, finish, states, update.token_ids)

        async for text in self._sse(job, obj, body):
            yield text

    # ---- shared ------------------------------------------------------------------------------

    def _submit(self, requests: list[EngineRequest]) -> Stream:
        try:
            return self.state.client.submit(requests)
        except EngineDeadError:
            raise engine_dead() from None
        except RequestRejected as exc:
            raise bad_request(str(exc)) from None

    async def _collect(self, request: Request, job: _Job) -> list[ChoiceState]:
        states = [ChoiceState() for _ in range(job.num_choices)]
        try:
            await collect(request, job.stream, lambda i, u: states[i].add(u))
        except EngineDeadError:
            raise engine_dead() from None
        except RequestRejected as exc:
            raise from_value_error(exc) from None
        for s in states:
            if s.error:
                raise ApiError(500, s.error)
        return states

    async def _sse(self, job: _Job, obj: str, body: Any) -> AsyncIterator[str]:
        """The events of `body`, the usage chunk when asked, [DONE]; an error after the stream
        started goes out as a `data: {"error": ...}` event, then [DONE]."""
        states = [ChoiceState() for _ in range(job.num_choices)]
        try:
            async for text in body(states):
                yield text
            if job.include_usage:
                yield sse(usage_chunk(job.id, obj, job.created, job.model,
                                      usage([len(p) for p in job.prompts], states, job.n)))
        except EngineDeadError:
            yield sse_error(503, engine_dead().message)
        except RequestRejected as exc:
            err = from_value_error(exc)
            yield sse_error(err.status, err.message)
        except ApiError as exc:
            yield sse_error(exc.status, exc.message)
        except Exception as exc:  # noqa: BLE001 - the stream must end properly
            logger.exception("stream %s failed", job.id)
            yield sse_error(500, f"internal error: {exc}")
        finally:
            job.stream.close()
        yield DONE


def _check_stream_options(stream: bool, has_options: bool) -> None:
    if has_options and not stream:
        raise bad_request("stream_options can only be given with stream=true", "stream_options")


def _raise_update_error(update: Update) -> None:
    if update.error:
        raise ApiError(500, update.error)
