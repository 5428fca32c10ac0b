"""`banyan serve` end to end: a real server process (API server + engine process) on a free
localhost port with the tiny llama, driven by the official openai client and raw httpx.

One server for the whole module (start-up costs seconds); tests/test_server_errors.py and
tests/test_server_lifecycle.py start their own (tests/server_helpers.py).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.server_helpers import (
    ServerProcess,
    metric_values,
    running_server,
    sse_events,
    wait_idle_and_free,
)
from tests.http_client import HTTP


# ---- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(llama_dir, tmp_path_factory.mktemp("server")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> OpenAI:
    return server.openai()


PROMPT = "def main(): print('café 東京')"
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


# ---- completions and chat ----------------------------------------------------------------------


def test_models_endpoint(client: OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]


def test_completion_streamed_equals_non_streamed(client: OpenAI) -> None:
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, **GREEDY)
    choice = full.choices[0]
    assert choice.finish_reason == "length"
    assert full.usage.completion_tokens == 24
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, stream=True,
                                       **GREEDY)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # include_usage off: no usage chunk


def test_chat_streamed_equals_non_streamed(client: OpenAI) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}]
    full = client.chat.completions.create(model="tiny", messages=messages,
                                          max_completion_tokens=20, **GREEDY)
    assert full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens == 20
    chunks = list(client.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=20, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    # The chat template was applied: the prompt is the rendered conversation.
    tokenized = HTTP.post(str(client.base_url).replace("/v1/", "/tokenize"),
                           json={"messages": messages}).json()
    assert tokenized["count"] == full.usage.prompt_tokens


def test_n_samples(client: OpenAI) -> None:
    out = client.completions.create(model="tiny", prompt="import os", max_tokens=8, n=2,
                                    temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 16
    assert out.usage.prompt_tokens == len(HTTP.post(
        str(client.base_url).replace("/v1/", "/tokenize"), json={"prompt": "import os"}
    ).json()["tokens"])
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=6,
        stream=True, extra_body={"ignore_eos": True})
    texts = {0: "", 1: ""}
    finished = set()
    for c in chat:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1}


def test_list_prompts_and_token_ids(client: OpenAI) -> None:
    ids = HTTP.post(str(client.base_url).replace("/v1/", "/tokenize"),
                     json={"prompt": "class A:"}).json()["tokens"]
    by_text = client.completions.create(model="tiny", prompt=["class A:", "x = 1"],
                                        max_tokens=5, **GREEDY)
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=5, **GREEDY)
    assert [c.index for c in by_text.choices] == [0, 1]
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_text.usage.completion_tokens == 10


def test_logprobs_shapes(client: OpenAI) -> None:
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, logprobs=3,
                                    **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert len(lp.text_offset) == 6 and lp.text_offset == sorted(lp.text_offset)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 4
        assert chosen <= 0 and abs(chosen - max(top.values())) < 1e-4  # greedy: the best one
    # echo: the prompt comes first, with its logprobs (null for the first token only).
    echo = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, logprobs=1,
                                     echo=True, **GREEDY)
    prompt_len = echo.usage.prompt_tokens
    elp = echo.choices[0].logprobs
    assert echo.choices[0].text.startswith(PROMPT)
    assert len(elp.tokens) == prompt_len + 2
    assert elp.token_logprobs[0] is None and elp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in elp.token_logprobs[1:])
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=5,
        logprobs=True, top_logprobs=2, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert isinstance(entry.bytes, list) and all(0 <= b < 256 for b in entry.bytes)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    streamed = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=5,
        logprobs=True, top_logprobs=2, stream=True, **GREEDY))
    entries = [e for c in streamed if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]
    assert [e.token for e in entries] == [e.token for e in content]


def test_stop_strings(client: OpenAI) -> None:
    base = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30,
                                     **GREEDY).choices[0].text
    # A stop string from the middle of the greedy text: the output must end right before its
    # first occurrence.
    start = next(i for i in range(4, len(base) - 2) if base[i:i + 2].isalnum())
    stop = base[start:start + 2]
    expected = base[: base.find(stop)]
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, stop=[stop],
                                    **GREEDY)
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30,
                                         stop=stop, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed) == expected
    # vLLM's include_stop_str_in_output (SGLang's no_stop_trim): the stop string ends the text.
    kept = expected + stop
    keep = {"temperature": 0.0,
            "extra_body": {"ignore_eos": True, "include_stop_str_in_output": True}}
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, stop=[stop],
                                    **keep)
    assert (out.choices[0].text, out.choices[0].finish_reason) == (kept, "stop")
    streamed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, stop=stop,
                                         stream=True, **keep)
    assert "".join(c.choices[0].text for c in streamed) == kept
    native = HTTP.post(str(client.base_url).replace("/v1/", "/generate"), timeout=60,
                       json={"text": PROMPT, "sampling_params": {
                           "max_new_tokens": 30, "temperature": 0, "stop": stop,
                           "no_stop_trim": True}})
    assert native.status_code == 200 and native.json()["text"] == kept, native.text


def test_seed_reproducible(client: OpenAI) -> None:
    def sample(seed: int) -> list[str]:
        out = client.completions.create(model="tiny", prompt="for i in", max_tokens=12, n=2,
                                        temperature=1.0, top_p=0.95, seed=seed,
                                        extra_body={"ignore_eos": True, "top_k": 50})
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)]

    first = sample(1234)
    assert sample(1234) == first


def test_sse_format_and_usage(server: ServerProcess) -> None:
    body = {"model": "tiny", "prompt": "while True:", "max_tokens": 7, "ignore_eos": True,
            "temperature": 0, "stream": True}
    for include in (None, False, True):
        req = dict(body)
        if include is not None:
            req["stream_options"] = {"include_usage": include}
        with HTTP.stream("POST", f"{server.url}/v1/completions", json=req) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = sse_events(r.iter_lines())
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        usage_chunks = [c for c in chunks if not c["choices"]]
        if include:
            assert len(usage_chunks) == 1 and chunks[-1] is usage_chunks[0]
            usage = usage_chunks[0]["usage"]
            assert usage["completion_tokens"] == 7
            assert usage["total_tokens"] == usage["prompt_tokens"] + 7
            assert "cached_tokens" in usage["prompt_tokens_details"]
            assert all(c["usage"] is None for c in chunks[:-1])
        else:
            assert not usage_chunks and all("usage" not in c for c in chunks)
    # vLLM's continuous_usage_stats: every chunk's usage so far, its own choice's
    for path, extra in (("completions", {"prompt": "while True:", "n": 2}),
                        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        req = {**body, **extra, "stream_options": {"include_usage": True,
                                                   "continuous_usage_stats": True}}
        with HTTP.stream("POST", f"{server.url}/v1/{path}", json=req) as r:
            chunks = [json.loads(e) for e in sse_events(r.iter_lines())[:-1]]
        *streamed, last = chunks
        prompt = last["usage"]["prompt_tokens"]
        for index in range(extra.get("n", 1)):
            mine = [c["usage"] for c in streamed if c["choices"][0]["index"] == index]
            done = [u["completion_tokens"] for u in mine]
            assert done == sorted(done) and done[-1] == 7 and done[0] <= 1, done
            assert all(u["prompt_tokens"] == prompt and u["total_tokens"] == prompt + d
                       for u, d in zip(mine, done, strict=True))
        assert last["usage"]["completion_tokens"] == 7 * extra.get("n", 1)


def test_cached_tokens_counted(client: OpenAI) -> None:
    prompt = "cached prompt: " + "abc def " * 20
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, **GREEDY)
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, **GREEDY)
    n = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # Everything but the last prompt token (its logits must be computed) comes from the cache.
    assert second.usage.prompt_tokens_details.cached_tokens == n - 1
    salted = client.completions.create(model="tiny", prompt=prompt, max_tokens=3,
                                       temperature=0, user="u1",
                                       extra_body={"cache_salt": "other-tenant",
                                                   "ignore_eos": True})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


# ---- native endpoints ----------------------------------------------------------------------


def test_native_endpoints(server: ServerProcess, client: OpenAI) -> None:
    tok = HTTP.post(f"{server.url}/tokenize", json={"prompt": PROMPT,
                                                     "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 1024
    detok = HTTP.post(f"{server.url}/detokenize", json={"tokens": tok["tokens"]}).json()
    assert detok["prompt"] == PROMPT
    gen = HTTP.post(f"{server.url}/generate", json={
        "text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                            "ignore_eos": True}}).json()
    expected = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, **GREEDY)
    assert gen["text"] == expected.choices[0].text
    assert len(gen["output_ids"]) == 6
    meta = gen["meta_info"]
    assert meta["finish_reason"]["type"] == "length"
    assert meta["prompt_tokens"] == tok["count"] and meta["completion_tokens"] == 6
    assert meta["cached_tokens"] > 0
    with HTTP.stream("POST", f"{server.url}/generate", json={
            "input_ids": tok["tokens"], "stream": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["text"] == gen["text"] and last["output_ids"] == gen["output_ids"]
    info = HTTP.get(f"{server.url}/server_info").json()
    assert info["model"] == "tiny" and info["kv_capacity"] > 0 and "step_times" in info
    flushed = HTTP.post(f"{server.url}/flush_cache")
    assert flushed.status_code == 200
    assert HTTP.get(f"{server.url}/server_info").json()["kv_evictable"] == 0


# ---- load, disconnects, metrics ---------------------------------------------------------------


def test_64_concurrent_streams(server: ServerProcess) -> None:
    async def one(aclient: AsyncOpenAI, i: int) -> tuple[str, str | None]:
        stream = await aclient.completions.create(
            model="tiny", prompt=f"request {i}: ", max_tokens=16, stream=True, temperature=0.7,
            seed=i, extra_body={"ignore_eos": True})
        text, finish = "", None
        async for c in stream:
            text += c.choices[0].text
            finish = c.choices[0].finish_reason or finish
        return text, finish

    async def run_all() -> list[tuple[str, str | None]]:
        async with AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                               timeout=120) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(64)))

    results = asyncio.run(run_all())
    assert len(results) == 64 and all(finish == "length" for _, finish in results)
    wait_idle_and_free(server.url)


def test_client_disconnect_aborts_and_frees_kv(server: ServerProcess) -> None:
    before = metric_values(server.url)[("banyan:request_success_total",
                                        (("finished_reason", "abort"),))]
    long = {"model": "tiny", "prompt": "x", "max_tokens": 1000, "ignore_eos": True}
    # Streamed: read two events, then hang up.
    with HTTP.stream("POST", f"{server.url}/v1/completions",
                      json={**long, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    # Not streamed: the client gives up waiting (8 x 1000 tokens take well over the timeout).
    with pytest.raises(httpx.ReadTimeout):
        HTTP.post(f"{server.url}/v1/chat/completions", timeout=0.25, json={
            "model": "tiny", "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 1000, "ignore_eos": True, "n": 8})
    info = wait_idle_and_free(server.url)
    assert info["num_running"] == 0 and info["num_waiting"] == 0
    after = metric_values(server.url)[("banyan:request_success_total",
                                       (("finished_reason", "abort"),))]
    assert after - before == 1 + 8  # the streamed sample and the eight chat samples


def test_metrics_move(server: ServerProcess, client: OpenAI) -> None:
    before = metric_values(server.url)
    out = client.completions.create(model="tiny", prompt="metrics test prompt", max_tokens=9,
                                    **GREEDY)
    # The engine's stats arrive with its outputs; the step that finished the request sent them.
    after = metric_values(server.url)

    def delta(name: str, labels: tuple = ()) -> float:
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert delta("banyan:generation_tokens_total") == 9
    assert delta("banyan:prompt_tokens_total") == out.usage.prompt_tokens
    assert delta("banyan:prefix_cache_queries_total") == out.usage.prompt_tokens
    assert delta("banyan:prefix_cache_hits_total") == out.usage.prompt_tokens_details.cached_tokens
    assert delta("banyan:request_success_total", (("finished_reason", "length"),)) == 1
    assert delta("banyan:time_to_first_token_seconds_count") == 1
    assert delta("banyan:e2e_request_latency_seconds_count") == 1
    assert delta("banyan:inter_token_latency_seconds_count") == 8
    assert delta("banyan:request_queue_time_seconds_count") == 1
    # a prefill and at least one decode step; 9 only where each step decodes one token (a
    # burst of decode steps, where the layer stack runs this model, is one engine step)
    assert delta("banyan:engine_steps_total") >= 2
    assert delta("banyan:step_phase_seconds_total", (("phase", "forward"),)) > 0
    wall = after[("banyan:step_wall_seconds_total", ())]
    busy = after[("banyan:device_busy_seconds_total", ())]
    idle = after[("banyan:execution_idle_seconds_total", ())]
    assert abs(busy + idle - wall) < 1e-6
    assert 0 < after[("banyan:device_busy_fraction", ())] <= 1
    assert after[("banyan:num_requests_running", ())] == 0
    assert 0 <= after[("banyan:kv_cache_usage_perc", ())] <= 1
    assert ("banyan:num_retractions_total", ()) in after
