"""Prefill/decode disaggregation in the router: every generation request goes first to a prefill
worker, for its prompt only (one token, not streamed), then to a decode worker told where the
prompt's K/V is (`kv_transfer_params.remote_addr`, the prefill worker's `x-banyan-kv-source`).
The decode worker's response is the client's, streamed through unchanged.

The prefill worker is chosen by the router's policy over the prefill workers (cache-aware by
default: the prompt's K/V is computed where most of it is cached); the decode worker by the same
policy over the decode workers, which also keep what they fetched in their prefix caches.

A prefill that fails (no prefill worker, a refused connection, an error answer) does not fail
the request: the decode worker is then sent the request as it came and computes the prompt
itself, as a colocated worker would. The client sees a slower first token, never an error the
prefill side caused.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import httpx

from banyan.router.args import RouterArgs
from banyan.router.policies import Policy
from banyan.router.proxy import Upstream
from banyan.router.workers import WorkerRegistry
from banyan.server.head import KV_SOURCE_HEADER

logger = logging.getLogger(__name__)

# What a prefill request must not do: stream, sample many, return logprobs or stop early. Its
# output is thrown away; only its K/V matters.
_OPENAI_DROP = ("stream_options", "logprobs", "top_logprobs", "echo", "min_tokens",
                "max_completion_tokens", "n", "best_of", "response_format", "structured_outputs",
                "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                "prompt_logprobs", "stop", "stop_token_ids")
_NATIVE_DROP = ("min_new_tokens", "n", "stop", "stop_token_ids", "json_schema", "regex",
                "ebnf", "structural_tag")


def prefill_body(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The request a prefill worker gets: the same prompt (and chat template inputs), one token."""
    out = dict(body)
    out["stream"] = False
    if path.startswith("/generate"):
        params = dict(out.get("sampling_params") or {})
        for key in _NATIVE_DROP:
            params.pop(key, None)
        params["max_new_tokens"] = 1
        out["sampling_params"] = params
        out["return_logprob"] = False
        out.pop("rid", None)
        return out
    for key in _OPENAI_DROP:
        out.pop(key, None)
    out["max_tokens"] = 1
    return out


class PrefillStage:
    def __init__(self, args: RouterArgs, registry: WorkerRegistry, policy: Policy,
                 client: httpx.AsyncClient) -> None:
        self.args = args
        self.registry = registry
        self.policy = policy
        self.client = client
        self.prefills = 0
        self.fallbacks = 0  # requests whose prompt the decode worker computed (no prefill)
        self.prefill_seconds = 0.0

    async def run(self, up: Upstream) -> Upstream:
        """`up` re-addressed to a decode worker, with the K/V's address when a prefill worker
        computed its prompt; `up` itself when none could."""
        try:
            body = json.loads(up.body)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return up  # the decode worker answers with the error
        payload = json.dumps(prefill_body(up.path, body)).encode()
        tried: set[str] = set()
        for _ in range(self.args.max_retries + 1):
            chosen = self.registry.choose(self.policy, up.key, tried)
            if chosen is None:
                break
            worker = chosen[0]
            tried.add(worker.url)
            self.registry.acquire(worker)
            t0 = time.perf_counter()
            try:
                response = await self.client.request(up.method, worker.url + up.path,
                                                     headers=up.headers, content=payload)
            except httpx.TransportError as exc:
                logger.warning("prefill on %s failed: %s", worker.url, exc)
                self.registry.mark_failed(worker, f"{type(exc).__name__}: {exc}")
                continue
            finally:
                self.registry.release(worker)
            source = response.headers.get(KV_SOURCE_HEADER.decode())
            if response.status_code == 503:
                self.registry.mark_failed(worker, "the worker answered 503")
                continue
            if response.status_code != 200 or not source:
                break  # a request the prefill worker refused: the decode worker will say why
            self.prefills += 1
            self.prefill_seconds += time.perf_counter() - t0
            body["kv_transfer_params"] = {"remote_addr": source}
            return Upstream(up.method, up.path, up.headers, json.dumps(body).encode(), up.key,
                            up.routed)
        self.fallbacks += 1
        return up
