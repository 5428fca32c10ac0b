"""The FastAPI app: routes, the API-key check, and errors in OpenAI's shape everywhere.

Built by `build_app(state)`; all state lives in the ServerState object (no module globals).
Handlers read their bodies themselves (`errors.read_body`) so that validation errors are 400s in
OpenAI's shape and the body-size limit holds, instead of FastAPI's 422 and unbounded bodies.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

import banyan
from banyan.server.engine_client import EngineDeadError
from banyan.server.errors import ApiError, engine_dead, error_body
from banyan.server.head import HeadAsGet, KVSourceHeader
from banyan.server.metrics import step_times_dict
from banyan.server.native import NativeServing
from banyan.server.openai_serving import OpenAIServing
from banyan.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
)
from banyan.server.responses import ResponsesRequest, ResponsesServing
from banyan.server.state import ServerState

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/metrics"})  # monitoring works without the API key


def bearer_matches(scope: Scope, key: bytes) -> bool:
    """`Authorization: Bearer KEY`, the scheme in any case (RFC 9110: it is case-insensitive),
    compared in constant time."""
    got = dict(scope["headers"]).get(b"authorization", b"")
    scheme, _, token = got.strip().partition(b" ")
    return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), key)


async def refuse(scope: Scope, receive: Receive, send: Send, status: int, message: str) -> None:
    await JSONResponse(error_body(status, message), status_code=status)(scope, receive, send)


class ApiKeyMiddleware:
    """`Authorization: Bearer KEY` on every path but OPEN_PATHS and `exempt` (which check keys
    of their own) (pure ASGI: no buffering of streamed responses, unlike BaseHTTPMiddleware)."""

    def __init__(self, app: ASGIApp, api_key: str,
                 exempt: Callable[[Scope], bool] | None = None) -> None:
        self.app = app
        self.key = api_key.encode()
        self.exempt = exempt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope["path"] in OPEN_PATHS
                or (self.exempt is not None and self.exempt(scope))
                or bearer_matches(scope, self.key)):
            await self.app(scope, receive, send)
            return
        await refuse(scope, receive, send, 401,
                     "invalid or missing API key (send `Authorization: Bearer KEY`)")


def publish_bodies(app: FastAPI, bodies: dict[tuple[str, str], type[BaseModel]]) -> None:
    """/openapi.json with the real request models: the handlers read their bodies themselves
    (for 400s instead of 422s, and the size limit), so FastAPI cannot see them; they are put
    into the schema here, by (method, path)."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for (method, path), model in bodies.items():
                model_schema = model.model_json_schema(
                    ref_template="#/components/schemas/{model}")
                components.update(model_schema.pop("$defs", {}))
                components[model.__name__] = model_schema
                ref = {"$ref": f"#/components/schemas/{model.__name__}"}
                schema["paths"][path][method]["requestBody"] = {
                    "required": True, "content": {"application/json": {"schema": ref}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="Banyan", version=banyan.__version__, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    openai = OpenAIServing(state)
    native = NativeServing(state)
    responses = ResponsesServing(state)

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)),
                            status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> Response:
        return JSONResponse(error_body(400, str(exc)), status_code=400)

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(request: Request, exc: EngineDeadError) -> Response:
        return engine_dead().response()

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error in %s", request.url.path)
        return JSONResponse(error_body(500, f"internal error: {exc}"), status_code=500)

    def require_engine() -> None:
        if state.client.dead:
            raise engine_dead()

    # ---- OpenAI ------------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        require_engine()
        return await openai.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        require_engine()
        return await openai.chat(request)

    @app.post("/v1/responses")
    async def responses_create(request: Request) -> Response:
        require_engine()
        return await responses.create(request)

    def model_card() -> dict[str, object]:
        return {"id": state.model_name, "object": "model", "created": int(state.started),
                "owned_by": "banyan", "root": state.model_path,
                "max_model_len": state.engine.max_model_len}

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        state.check_model(model)
        return JSONResponse(model_card())

    # ---- native ------------------------------------------------------------------------------

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        require_engine()
        return await native.generate(request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await native.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await native.detokenize(request)

    # ---- operations --------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        if state.client.dead:
            return engine_dead().response()
        return JSONResponse({"status": "ok"})

    @app.get("/server_info")
    async def server_info() -> Response:
        require_engine()
        reply = await state.client.control("info")
        args = dataclasses.asdict(state.args)
        args["api_key"] = None if state.args.api_key is None else "***"
        stats = state.metrics.engine
        return JSONResponse({
            "version": banyan.__version__, "model": state.model_name,
            "model_path": state.model_path, "api_server_pid": os.getpid(),
            "server_args": args, **reply.data,
            "last_stats_step_times": step_times_dict(stats.times),
        })

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        require_engine()
        reply = await state.client.control("flush_cache")
        if not reply.ok:
            raise ApiError(400, reply.message)
        return JSONResponse({"success": True, "message": reply.message})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    publish_bodies(app, {("post", "/v1/completions"): CompletionRequest,
                         ("post", "/v1/chat/completions"): ChatCompletionRequest,
                         ("post", "/v1/responses"): ResponsesRequest,
                         ("post", "/generate"): GenerateRequest,
                         ("post", "/tokenize"): TokenizeRequest,
                         ("post", "/detokenize"): DetokenizeRequest})
    if state.args.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=state.args.api_key)
    app.add_middleware(HeadAsGet)
    if state.engine.kv_source:
        app.add_middleware(KVSourceHeader, address=state.engine.kv_source)
    return app
