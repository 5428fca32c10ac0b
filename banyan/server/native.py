"""SGLang-style native endpoints: POST /generate, /tokenize, /detokenize."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from banyan.server.engine_client import EngineDeadError, EngineRequest, RequestRejected, Stream
from banyan.server.errors import ApiError, bad_request, engine_dead, from_value_error, read_body
from banyan.server.openai_format import DONE, ChoiceState, lp, sse, sse_error
from banyan.server.protocol import DetokenizeRequest, GenerateRequest, TokenizeRequest
from banyan.server.structured_api import structured_spec
from banyan.server.state import (
    ServerState,
    SSEResponse,
    check_ids,
    collect,
    encode_chat,
    encode_text,
)


class NativeServing:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def generate(self, request: Request) -> Response:
        st = self.state
        body: GenerateRequest = await read_body(request, GenerateRequest,
                                                st.args.max_request_bytes,
                                                st.args.request_body_timeout)
        if (body.text is None) == (body.input_ids is None):
            raise bad_request("give exactly one of text and input_ids", "text")
        ids_in = body.input_ids
        single = isinstance(body.text, str) or (
            ids_in is not None and (not ids_in or isinstance(ids_in[0], int)))
        if body.text is not None:
            texts = [body.text] if isinstance(body.text, str) else list(body.text)
            prompts = [check_ids(st, await encode_text(st, t, "text"), "text") for t in texts]
        else:
            raw: Any = body.input_ids
            id_lists = [raw] if single else raw
            prompts = [check_ids(st, ids, "input_ids") for ids in id_lists]
        if not prompts:
            raise bad_request("no prompt given", "text")
        if len(prompts) > st.args.max_prompts:
            raise bad_request(f"{len(prompts)} prompts; the limit is {st.args.max_prompts}")
        n = body.sampling_params.n
        st.check_n(n)
        base = body.rid or uuid.uuid4().hex
        requests = []
        structured = structured_spec(body.sampling_params)
        for i, ids in enumerate(prompts):
            params = body.sampling_params.to_params(
                body.top_logprobs_num if body.return_logprob else None)
            explicit = "max_new_tokens" in body.sampling_params.model_fields_set
            params.max_new_tokens = st.max_new_tokens(len(ids), params.max_new_tokens, explicit,
                                                      "input_ids", "max_new_tokens")
            params.structured = structured
            rid = base if len(prompts) == 1 else f"{base}-{i}"
            requests.append(EngineRequest(rid, ids, st.validate(params), body.cache_salt,
                                          body.kv_source))
        try:
            stream = st.client.submit(requests)
        except EngineDeadError:
            raise engine_dead() from None
        except RequestRejected as exc:
            raise bad_request(str(exc)) from None
        rids = [r.rid if n == 1 else f"{r.rid}#{k}" for r in requests for k in range(n)]
        lens = [len(p) for p in prompts for _ in range(n)]
        if body.stream:
            return SSEResponse(self._stream(stream, rids, lens, body.return_logprob,
                                            multi=len(rids) > 1), stream.close)
        states = [ChoiceState() for _ in rids]
        try:
            await collect(request, stream, lambda i, u: states[i].add(u))
        except EngineDeadError:
            raise engine_dead() from None
        except RequestRejected as exc:
            raise from_value_error(exc) from None
        for s in states:
            if s.error:
                raise ApiError(500, s.error)
        outs = [_result(rids[i], s, lens[i], body.return_logprob) for i, s in enumerate(states)]
        return JSONResponse(outs[0] if single and n == 1 else outs)

    async def _stream(self, stream: Stream, rids: list[str], lens: list[int], logprob: bool,
                      multi: bool) -> AsyncIterator[str]:
        """SGLang's stream: each event carries the whole text and ids so far."""
        states = [ChoiceState() for _ in rids]
        try:
            async for index, update in stream.events():
                states[index].add(update)
                if update.error:
                    raise ApiError(500, update.error)
                out = _result(rids[index], states[index], lens[index], logprob)
                if multi:
                    out["index"] = index
                yield sse(out)
        except EngineDeadError:
            yield sse_error(503, engine_dead().message)
        except RequestRejected as exc:
            yield sse_error(400, str(exc))
        except ApiError as exc:
            yield sse_error(exc.status, exc.message)
        finally:
            stream.close()
        yield DONE

    async def tokenize(self, request: Request) -> Response:
        st = self.state
        body: TokenizeRequest = await read_body(request, TokenizeRequest,
                                                st.args.max_request_bytes,
                                                st.args.request_body_timeout)
        st.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        if body.prompt is not None:
            ids = await encode_text(st, body.prompt, "prompt", body.add_special_tokens)
        else:
            try:
                messages = [m.template_dict() for m in body.messages or []]
            except ValueError as exc:
                raise bad_request(str(exc), "messages") from None
            ids = await encode_chat(st, messages, body.add_generation_prompt, False,
                                    st.template_kwargs(body.chat_template_kwargs,
                                                       body.chat_template))
        out: dict[str, Any] = {"count": len(ids), "max_model_len": st.engine.max_model_len,
                               "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = [st.tok.token_text(t) for t in ids]
        return JSONResponse(out)

    async def detokenize(self, request: Request) -> Response:
        st = self.state
        body: DetokenizeRequest = await read_body(request, DetokenizeRequest,
                                                  st.args.max_request_bytes,
                                                st.args.request_body_timeout)
        st.check_model(body.model)
        try:
            st.tok.check_ids(body.tokens)
        except ValueError as exc:
            raise bad_request(str(exc), "tokens") from None
        return JSONResponse({"prompt": await st.tok.decode_async(body.tokens)})


def _result(rid: str, s: ChoiceState, prompt_len: int, logprob: bool) -> dict[str, Any]:
    finish: dict[str, Any] | None = None
    if s.finish_reason is not None:
        finish = {"type": s.finish_reason}
        if s.error:
            finish["message"] = s.error
    meta: dict[str, Any] = {"id": rid, "finish_reason": finish, "prompt_tokens": prompt_len,
                            "completion_tokens": len(s.token_ids),
                            "cached_tokens": s.cached_tokens}
    if logprob:
        meta["output_token_logprobs"] = [[lp(e.logprob), e.token_id, None] for e in s.logprobs]
        meta["output_top_logprobs"] = [
            [[lp(v), t, None] for t, v in zip(e.top_ids, e.top_logprobs)] for e in s.logprobs]
    return {"text": s.full_text, "output_ids": list(s.token_ids), "meta_info": meta}
