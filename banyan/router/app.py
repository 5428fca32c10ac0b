"""The router's FastAPI app and the object that owns its state and background tasks.

Endpoints: the generation endpoints (/v1/completions, /v1/chat/completions, /generate) go to the
worker the policy picks; /v1/models, /tokenize, /detokenize to any healthy worker; /flush_cache to
all of them. /health is 200 while at least one worker takes traffic. /workers lists (GET), adds
(POST {"url"}) and removes (DELETE {"url"} or ?url=: the worker drains first) workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import banyan
from banyan.router.args import RouterArgs
from banyan.router.keys import route_key
from banyan.router.metrics import RouterMetrics
from banyan.router.policies import Policy, make_policy
from banyan.router.proxy import Proxy, Upstream, forward_headers
from banyan.router.workers import WorkerRegistry
from banyan.server.api_server import ApiKeyMiddleware
from banyan.server.errors import ApiError, bad_request, error_body, read_raw_body

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Router:
    args: RouterArgs
    client: httpx.AsyncClient
    policy: Policy
    registry: WorkerRegistry
    metrics: RouterMetrics
    proxy: Proxy
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def start(self) -> None:
        """Check the given workers once (so traffic can flow at once), then keep checking."""
        for url in self.args.workers:
            self.registry.add(url)
        await self.registry.check_all()
        healthy = sum(w.healthy for w in self.registry.all())
        logger.info("router: %d of %d workers healthy, policy %s", healthy,
                    len(self.registry.all()), self.policy.name)
        loop = asyncio.get_running_loop()
        self.tasks.append(loop.create_task(self.registry.run_checks()))
        self.tasks.append(loop.create_task(self._evict_loop()))

    async def _evict_loop(self) -> None:
        while True:
            await asyncio.sleep(self.args.eviction_interval)
            try:
                self.policy.maintain()
            except Exception:  # noqa: BLE001 - keep evicting next time
                logger.exception("tree eviction failed")

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.client.aclose()


def build_router(args: RouterArgs) -> Router:
    # No read timeout (a non-streamed generation sends nothing until it is done) and no pool
    # limit (the workers' own admission is the limit; httpx's default of 100 would queue here).
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=args.connect_timeout),
                               limits=httpx.Limits(max_connections=None,
                                                   max_keepalive_connections=512))
    policy = make_policy(args)
    # The policy object lives as long as the router, so forget() can be bound once.
    registry = WorkerRegistry(args, client, on_lost=policy.forget)
    metrics = RouterMetrics(policy.name, registry.all, policy.tree_sizes)
    return Router(args, client, policy, registry, metrics,
                  Proxy(args, registry, policy, metrics, client))


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        data = msgspec.json.decode(await request.body())
    except msgspec.DecodeError:
        data = None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    return data


def build_app(router: Router) -> FastAPI:
    app = FastAPI(title="Banyan router", version=banyan.__version__, docs_url=None,
                  redoc_url=None, openapi_url=None)
    args, registry, proxy = router.args, router.registry, router.proxy

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)),
                            status_code=exc.status_code)

    async def forward(request: Request, routed: bool) -> Response:
        body = await read_raw_body(request, args.max_request_bytes)
        key = None
        if routed:
            # Not JSON: no key to route on; the worker will answer with the error.
            with contextlib.suppress(msgspec.DecodeError):
                key = route_key(request.url.path, msgspec.json.decode(body))
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return proxy.response(Upstream(request.method, path,
                                       forward_headers(request.headers.raw), body, key, routed))

    # ---- proxied -----------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(request, routed=True)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await forward(request, routed=True)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await forward(request, routed=True)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await forward(request, routed=False)

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> Response:
        return await forward(request, routed=False)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await forward(request, routed=False)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await forward(request, routed=False)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request) -> Response:
        """Every worker's prefix cache, and the router's trees with them."""
        workers = registry.candidates()
        headers = forward_headers(request.headers.raw)

        async def one(url: str) -> dict[str, Any]:
            try:
                r = await router.client.post(f"{url}/flush_cache", headers=headers,
                                             timeout=args.health_check_timeout)
                return {"url": url, "status": r.status_code}
            except httpx.HTTPError as exc:
                return {"url": url, "status": None, "error": f"{type(exc).__name__}: {exc}"}

        results = await asyncio.gather(*(one(w.url) for w in workers))
        router.policy.flush()
        ok = all(r["status"] == 200 for r in results)
        return JSONResponse({"success": ok, "workers": results}, status_code=200 if ok else 502)

    # ---- operations --------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        n = len(registry.candidates())
        if n == 0:
            return JSONResponse(error_body(503, "no healthy worker"), status_code=503)
        return JSONResponse({"status": "ok", "healthy_workers": n})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/workers")
    async def list_workers() -> Response:
        return JSONResponse({"policy": router.policy.name,
                             "workers": [w.info() for w in registry.all()]})

    @app.post("/workers")
    async def add_worker(request: Request) -> Response:
        url = (await _json_body(request)).get("url")
        if not isinstance(url, str):
            raise bad_request("give the worker as {\"url\": \"http://host:port\"}", "url")
        try:
            worker = registry.add(url)
        except ValueError as exc:
            raise bad_request(str(exc), "url") from None
        await registry.check(worker)  # traffic can flow now, not at the next check
        return JSONResponse(worker.info())

    @app.delete("/workers")
    async def remove_worker(request: Request) -> Response:
        url = request.query_params.get("url")
        if url is None:
            url = (await _json_body(request)).get("url")
        if not isinstance(url, str):
            raise bad_request("give the worker as ?url=... or {\"url\": ...}", "url")
        worker = registry.remove(url)
        if worker is None:
            raise ApiError(404, f"no worker {url!r}", "url")
        removed = registry.get(worker.url) is None
        return JSONResponse({**worker.info(), "state": "removed" if removed else "draining"})

    if args.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key)
    return app
