"""`banyan bench serve`: drive any OpenAI-compatible endpoint (Banyan's, vLLM's, SGLang's) with a
workload, streaming, and record every request.

Requests go to /v1/completions with the prompt as token ids (exact lengths; vLLM, SGLang and
Banyan take token-id prompts), or as text (--prompt-format text), or to /v1/chat/completions as
messages; always greedy, `ignore_eos: true`, `stream: true` and `stream_options.include_usage`.
Every prompt is built before the clock starts. Requests that continue another one (multi-turn,
agent, tree of thought) are sent when that one has ended, with the scripted answer in the
history (the API returns text, not the generated ids). Roots arrive all at once, or as a
Poisson process at --request-rate; --concurrency caps the requests in flight.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from banyan.bench import pd_split
from banyan.bench.metrics import RequestRecord
from banyan.bench.text import TextPrompts, chat_prompt_ids
from banyan.bench.workloads import Workload, optimal_reuse

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ServeOptions:
    base_url: str
    model: str | None = None  # None: the first model /v1/models lists
    endpoint: str = "completions"  # completions | chat
    prompt_format: str = "ids"  # ids | text (completions only; chat is always text)
    request_rate: float = math.inf  # roots per second (Poisson); inf: all at once
    concurrency: int | None = None  # most requests in flight
    seed: int = 0  # arrival times
    timeout_s: float = 3600.0
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    warmup: bool = True
    flush_cache: bool = False
    progress: bool = True


@dataclass(slots=True)
class Prepared:
    path: str
    body: dict[str, Any]
    tokens: list[int]  # the prompt as the server will tokenize it

    @property
    def prompt_tokens(self) -> int:
        return len(self.tokens)


@dataclass(slots=True)
class ServeRun:
    records: list[RequestRecord]
    duration_s: float
    model: str
    max_in_flight: int
    reusable_tokens: int  # the optimum of prefix reuse over the prompts as the server sees them
    # A `route --pd` router: its and its decode workers' counters before and after the run.
    pd_counters: tuple[dict[str, float] | None, dict[str, float] | None] = (None, None)


def root_url(base_url: str) -> str:
    return base_url.rstrip("/").removesuffix("/v1")


def prepare(workload: Workload, tokenizer: Any, endpoint: str, prompt_format: str,
            model: str) -> list[Prepared]:
    """The body of every request, and its prompt tokens as the tokenizer counts them."""
    if endpoint not in ("completions", "chat"):
        raise ValueError(f"endpoint must be completions or chat, got {endpoint!r}")
    if prompt_format not in ("ids", "text"):
        raise ValueError(f"prompt format must be ids or text, got {prompt_format!r}")
    common = {"model": model, "temperature": 0.0, "stream": True,
              "ignore_eos": not workload.stop_at_eos,
              "stream_options": {"include_usage": True}}
    out: list[Prepared] = []
    if endpoint == "completions" and prompt_format == "ids":
        for prompt, r in zip(workload.scripted_prompts(), workload.requests):
            out.append(Prepared("/v1/completions",
                                {**common, "prompt": prompt, "max_tokens": r.output_len},
                                prompt))
        return out
    texts = TextPrompts(tokenizer)
    if endpoint == "completions":
        for prompt, r in zip(workload.scripted_prompts(), workload.requests):
            text = texts.text(prompt)
            ids = list(tokenizer.encode(text))  # with the special tokens the server adds
            out.append(Prepared("/v1/completions",
                                {**common, "prompt": text, "max_tokens": r.output_len}, ids))
        return out
    chains: list[list[dict[str, str]]] = []
    for r in workload.requests:
        history = [] if r.parent is None else chains[r.parent] + [
            {"role": "assistant", "content": texts.text(workload.requests[r.parent].answer_ids)}]
        messages = history + [{"role": "user", "content": texts.text(r.prompt_ids)}]
        chains.append(messages)
        out.append(Prepared("/v1/chat/completions",
                            {**common, "messages": messages, "max_tokens": r.output_len},
                            chat_prompt_ids(tokenizer, messages)))
    return out


def _error_message(status: int, raw: bytes) -> str:
    try:
        data = json.loads(raw)
        err = data.get("error", data) if isinstance(data, dict) else data
        msg = err.get("message") if isinstance(err, dict) else None
        return f"HTTP {status}: {msg or str(data)[:200]}"
    except (ValueError, AttributeError):
        return f"HTTP {status}: {raw[:200].decode(errors='replace')}"


async def send(client: httpx.AsyncClient, url: str, body: dict[str, Any], rec: RequestRecord,
               tokenizer: Any, t_run: float) -> None:
    """POST one streaming request and fill `rec`; never raises (a failure is recorded)."""
    t0 = time.perf_counter()
    rec.start = t0 - t_run
    last: float | None = None
    text_parts: list[str] = []
    done = False
    try:
        async with client.stream("POST", url, json=body) as resp:
            rec.http_status = resp.status_code
            if resp.status_code != 200:
                rec.error = _error_message(resp.status_code, await resp.aread())
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments and other fields
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj or obj.get("object") == "error":
                    err = obj.get("error", obj)
                    rec.error = f"stream error: {err.get('message', err)}"
                    break
                now = time.perf_counter()
                if obj.get("usage"):
                    _read_usage(rec, obj["usage"])
                for choice in obj.get("choices") or []:
                    delta = choice.get("text")
                    if delta is None:
                        delta = (choice.get("delta") or {}).get("content")
                    if delta:
                        text_parts.append(delta)
                        if rec.ttft is None:
                            rec.ttft = now - t0
                        elif last is not None:
                            rec.itl.append(now - last)
                        last = now
                    if choice.get("finish_reason"):
                        rec.finish_reason = choice["finish_reason"]
                        if rec.ttft is None:  # an output that decodes to no text at all
                            rec.ttft = now - t0
    except (httpx.HTTPError, OSError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        rec.latency = time.perf_counter() - t0
    if rec.error is None and not done:
        rec.error = "the stream ended without [DONE]"
    text = "".join(text_parts)
    rec.output_tokens_tokenizer = len(tokenizer.encode(text, add_special_tokens=False))
    if rec.server_completion_tokens is not None:
        rec.output_tokens = rec.server_completion_tokens
    else:
        rec.output_tokens = rec.output_tokens_tokenizer
    rec.success = rec.error is None


def _read_usage(rec: RequestRecord, usage: dict[str, Any]) -> None:
    rec.server_prompt_tokens = usage.get("prompt_tokens")
    rec.server_completion_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        rec.cached_tokens = int(details["cached_tokens"])


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each of n roots is sent: Poisson arrivals at `rate` per
    second (the first at 0), or all at 0 when the rate is infinite."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    rng = random.Random(seed)
    times, t = [], 0.0
    for i in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


async def run_async(workload: Workload, prepared: Sequence[Prepared], tokenizer: Any,
                    opts: ServeOptions) -> tuple[list[RequestRecord], float, int]:
    from tqdm import tqdm

    base = root_url(opts.base_url)
    records = [RequestRecord(i, p.prompt_tokens, r.output_len, r.group, r.parent,
                             exact=not workload.stop_at_eos)
               for i, (p, r) in enumerate(zip(prepared, workload.requests))]
    kids = workload.children()
    roots = workload.roots()
    arrivals = dict(zip(roots, arrival_times(len(roots), opts.request_rate, opts.seed)))
    sem = asyncio.Semaphore(opts.concurrency) if opts.concurrency else None
    in_flight = max_in_flight = 0
    bar = tqdm(total=len(records), desc="bench serve", unit="req", disable=not opts.progress)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(opts.timeout_s, connect=30.0)
    async with httpx.AsyncClient(base_url=base, headers=_headers(opts), limits=limits,
                                 timeout=timeout) as client:
        t_run = time.perf_counter()

        async def one(i: int, tg: asyncio.TaskGroup) -> None:
            nonlocal in_flight, max_in_flight
            delay = arrivals.get(i, 0.0) - (time.perf_counter() - t_run)
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is not None:
                await sem.acquire()
            in_flight += 1
            max_in_flight = max(max_in_flight, in_flight)
            try:
                await send(client, prepared[i].path, prepared[i].body, records[i], tokenizer,
                           t_run)
            finally:
                in_flight -= 1
                if sem is not None:
                    sem.release()
            bar.update(1)
            for child in kids[i]:  # the scripted history does not depend on this one's output
                tg.create_task(one(child, tg))

        async with asyncio.TaskGroup() as tg:
            for i in roots:
                tg.create_task(one(i, tg))
        duration = time.perf_counter() - t_run
    bar.close()
    return records, duration, max_in_flight


def _headers(opts: ServeOptions) -> dict[str, str]:
    return {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}


def discover_model(opts: ServeOptions) -> str:
    resp = httpx.get(f"{root_url(opts.base_url)}/v1/models", headers=_headers(opts), timeout=30)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


def flush_cache(opts: ServeOptions) -> bool:
    """Ask the server to drop its prefix cache: /flush_cache (Banyan, SGLang) or
    /reset_prefix_cache (vLLM, dev mode). False when neither worked."""
    base = root_url(opts.base_url)
    for path in ("/flush_cache", "/reset_prefix_cache"):
        try:
            if httpx.post(base + path, headers=_headers(opts), timeout=30).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
    logger.warning("the server did not flush its prefix cache (neither /flush_cache nor "
                   "/reset_prefix_cache answered 200)")
    return False


def run_serve(workload: Workload, tokenizer: Any, opts: ServeOptions) -> ServeRun:
    model = opts.model or discover_model(opts)
    prepared = prepare(workload, tokenizer, opts.endpoint, opts.prompt_format, model)
    for p in prepared:
        p.body.update(opts.extra_body)
    if opts.warmup:
        _warmup(prepared[0], tokenizer, opts)
    if opts.flush_cache:
        flush_cache(opts)
    reusable = optimal_reuse([p.tokens for p in prepared])  # the server never saw the answers
    before = pd_split.snapshot(root_url(opts.base_url), _headers(opts))
    records, duration, peak = asyncio.run(run_async(workload, prepared, tokenizer, opts))
    after = pd_split.snapshot(root_url(opts.base_url), _headers(opts)) if before else None
    return ServeRun(records, duration, model, peak, reusable, (before, after))


def _warmup(first: Prepared, tokenizer: Any, opts: ServeOptions) -> None:
    """One short request that is not recorded (connections, lazy initialisation)."""
    body = dict(first.body, max_tokens=4)
    if isinstance(body.get("prompt"), list):  # ids: not a prefix of any workload prompt
        body["prompt"] = list(reversed(body["prompt"][:16]))
    elif "prompt" in body:
        body["prompt"] = "warm up"
    else:
        body["messages"] = [{"role": "user", "content": "warm up"}]
    rec = RequestRecord(-1, 0, 4)

    async def go() -> None:
        async with httpx.AsyncClient(base_url=root_url(opts.base_url), headers=_headers(opts),
                                     timeout=httpx.Timeout(opts.timeout_s, connect=30)) as c:
            await send(c, first.path, body, rec, tokenizer, time.perf_counter())

    asyncio.run(go())
    if not rec.success:
        logger.warning("warm-up request failed: %s", rec.error)
