"""The router's FastAPI app and the object that owns its state and background tasks.

Endpoints: the generation endpoints (/v1/completions, /v1/chat/completions, /generate) go to the
worker the policy picks; /v1/models, /tokenize, /detokenize to any healthy worker; /flush_cache to
all of them. /health is 200 while at least one worker takes traffic. /workers lists (GET), adds
(POST {"url"}) and removes (DELETE {"url"} or ?url=: the worker drains first) workers.

Changing the workers re-points every client's traffic, so it is an admin's act: it needs
--admin-api-key (a key of its own: API users cannot do it), and JSON (a web page can send a
text/plain POST anywhere without asking; it cannot send application/json without a CORS
preflight, which the router never answers). Everything the router answers itself is an
OpenAI-shaped JSON error, never a plain-text 500.
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
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Scope

import banyan
from banyan.router.args import RouterArgs
from banyan.router.keys import route_key
from banyan.router.metrics import RouterMetrics
from banyan.router.pd import PrefillStage
from banyan.router.policies import Policy, make_policy
from banyan.router.proxy import Proxy, Upstream, forward_headers
from banyan.router.workers import WorkerRegistry
from banyan.server.api_server import ApiKeyMiddleware, bearer_matches
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
        prefill = self.proxy.prefill
        if prefill is not None:
            for url in self.args.prefill_workers:
                prefill.registry.add(url)
            await prefill.registry.check_all()
            self.tasks.append(asyncio.get_running_loop().create_task(
                prefill.registry.run_checks()))
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
    # The read timeout is the worker timeout: the longest a worker may stay silent. No pool
    # limit (the workers' own admission is the limit; httpx's default of 100 would queue here).
    client = httpx.AsyncClient(timeout=httpx.Timeout(args.worker_timeout,
                                                     connect=args.connect_timeout, pool=None),
                               limits=httpx.Limits(max_connections=None,
                                                   max_keepalive_connections=512))
    policy = make_policy(args)
    # The policy object lives as long as the router, so forget() can be bound once.
    registry = WorkerRegistry(args, client, on_lost=policy.forget)
    prefill = None
    if args.pd:
        prefill_policy = make_policy(args)
        prefill = PrefillStage(args, WorkerRegistry(args, client, on_lost=prefill_policy.forget),
                               prefill_policy, client)
    metrics = RouterMetrics(policy.name, registry.all, policy.tree_sizes, prefill)
    return Router(args, client, policy, registry, metrics,
                  Proxy(args, registry, policy, metrics, client, prefill))


ADMIN_METHODS = frozenset({"POST", "DELETE"})


def is_admin(scope: Scope) -> bool:
    return scope["path"] == "/workers" and scope.get("method") in ADMIN_METHODS


def check_admin(request: Request, args: RouterArgs) -> None:
    """The admin key, or (only when allowed) no key and no browser."""
    if args.admin_api_key is not None:
        if not bearer_matches(request.scope, args.admin_api_key.encode()):
            raise ApiError(401, "changing the workers needs the admin key (`Authorization: "
                           "Bearer ADMIN_KEY`)")
        return
    if not args.allow_admin_without_key:
        raise ApiError(403, "changing the workers is off: start the router with "
                       "--admin-api-key (or --allow-admin-without-key on a trusted network)")
    # A browser says where the page came from; curl and scripts do not. A page must never
    # re-point the router, whatever origin it claims.
    site = request.headers.get("sec-fetch-site")
    if "origin" in request.headers or (site is not None and site != "none"):
        raise ApiError(403, "changing the workers from a web page is refused")


async def _json_body(request: Request, args: RouterArgs) -> dict[str, Any]:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise ApiError(415, "send the body as JSON (Content-Type: application/json)")
    raw = await read_raw_body(request, args.max_request_bytes, args.request_body_timeout)
    try:
        data = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):
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

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> Response:
        return JSONResponse(error_body(400, str(exc)), status_code=400)

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error in %s", request.url.path)
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"),
                            status_code=500)

    async def forward(request: Request, routed: bool) -> Response:
        body = await read_raw_body(request, args.max_request_bytes, args.request_body_timeout)
        key = None
        if routed:
            # The key is a hint: a body it cannot make sense of (not JSON, odd shapes) goes to
            # the least-loaded worker, which answers with the error.
            try:
                key = route_key(request.url.path, msgspec.json.decode(body))
            except Exception:  # noqa: BLE001
                key = None
        # The path as the client sent it (still percent-encoded): the decoded one may hold
        # characters that are not allowed in a URL (httpx.InvalidURL: a 500).
        raw_path = request.scope.get("raw_path") or request.url.path.encode()
        path = raw_path.decode("latin-1") + (f"?{request.url.query}" if request.url.query
                                             else "")
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
        """Every worker's prefix cache (prefill workers too), and the router's trees."""
        workers = registry.candidates()
        if proxy.prefill is not None:
            workers += proxy.prefill.registry.candidates()
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
        if proxy.prefill is not None:
            proxy.prefill.policy.flush()
        # A worker that refused (busy: 400) is the caller's to retry, not a gateway failure;
        # one that could not be reached or failed is.
        statuses = [r["status"] for r in results]
        if all(st == 200 for st in statuses):
            status = 200
        elif all(st is not None and st < 500 for st in statuses):
            status = 400
        else:
            status = 502
        return JSONResponse({"success": status == 200, "workers": results}, status_code=status)

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
        check_admin(request, args)
        url = (await _json_body(request, args)).get("url")
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
        check_admin(request, args)
        url = request.query_params.get("url")
        if url is None:
            url = (await _json_body(request, args)).get("url")
        if not isinstance(url, str):
            raise bad_request("give the worker as ?url=... or {\"url\": ...}", "url")
        worker = registry.remove(url)
        if worker is None:
            raise ApiError(404, f"no worker {url!r}", "url")
        removed = registry.get(worker.url) is None
        return JSONResponse({**worker.info(), "state": "removed" if removed else "draining"})

    if args.api_key is not None:
        # With an admin key, the admin endpoints check that key instead (one Authorization
        # header cannot carry both).
        exempt = is_admin if args.admin_api_key is not None else None
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key, exempt=exempt)
    return app
