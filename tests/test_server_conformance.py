"""Client conformance against `banyan serve` (issue 15): prompt logprobs on /v1/completions
(OpenAI's echo + logprobs, vLLM's prompt_logprobs, max_tokens=0 as lm-evaluation-harness sends
it), the Responses API through the real openai client, the chat role chunk, HEAD on GET
endpoints, and vLLM-named metrics. One server for the module, with small prefill chunks so a
prompt of 80 tokens is computed in three chunks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from openai import OpenAI

from tests.hf_reference import hf_model
from tests.server_helpers import ServerProcess, metric_values, running_server
from tests.http_client import HTTP

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(llama_dir, tmp_path_factory.mktemp("conformance"),
                        "--chunked-prefill-size", "32", "--max-prefill-tokens", "32") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> OpenAI:
    return server.openai()


def reference(llama_dir: Path, prompt: list[int]) -> torch.Tensor:
    """transformers float32: [len(prompt) - 1] logprob of each prompt token after the first."""
    with torch.inference_mode():
        logits = hf_model(str(llama_dir))(torch.tensor([prompt])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)[:-1]
    return logprobs.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)


# ---- prompt logprobs ---------------------------------------------------------------------------


def test_echo_logprobs_max_tokens_0_match_transformers(client: OpenAI, llama_dir: Path) -> None:
    """lm-evaluation-harness's loglikelihood request: token ids, echo, logprobs, max_tokens=0.
    The prompt (80 tokens) is computed in 3 chunks; asked twice, the second time its prefix is
    in the prefix cache (recomputed for the logits, so still exact)."""
    prompt = torch.randint(3, 500, (80,), generator=torch.Generator().manual_seed(3)).tolist()
    want = reference(llama_dir, prompt)
    for _ in range(2):
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True,
                                        logprobs=2, temperature=0)
        choice = out.choices[0]
        lp = choice.logprobs
        assert choice.finish_reason == "length" and out.usage.completion_tokens == 0
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 80
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        got = torch.tensor(lp.token_logprobs[1:])
        assert torch.allclose(got, want, atol=TOLERANCE), (got - want).abs().max()
        assert all(1 <= len(top) <= 3 for top in lp.top_logprobs[1:])
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
        assert "".join(lp.tokens) == choice.text


def test_vllm_prompt_logprobs_and_echo_with_generation(client: OpenAI, llama_dir: Path,
                                                       server: ServerProcess) -> None:
    prompt = [5, 17, 99, 230, 11, 400, 7]
    want = reference(llama_dir, prompt)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0,
            "prompt_logprobs": 1, "ignore_eos": True}
    out = HTTP.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    entries = out["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt)
    for i, entry in enumerate(entries[1:]):
        mine = entry[str(prompt[i + 1])]
        assert abs(mine["logprob"] - want[i].item()) < TOLERANCE and mine["rank"] >= 1
        assert min(v["rank"] for v in entry.values()) == 1  # the top-1 alternative is listed
    # echo + logprobs with generated tokens: prompt then output, generation unchanged by it.
    echo = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, echo=True,
                                     logprobs=0, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert echo.choices[0].text.endswith(plain.choices[0].text)
    assert len(echo.choices[0].logprobs.tokens) == len(prompt) + 3
    # Streamed with echo: the echo chunk carries the prompt logprobs too.
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=3,
                                            echo=True, logprobs=0, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    first = chunks[0].choices[0].logprobs
    assert first.token_logprobs[0] is None and len(first.token_logprobs) == len(prompt)
    assert torch.allclose(torch.tensor(first.token_logprobs[1:]), want, atol=TOLERANCE)


def test_prompt_logprobs_out_of_range_is_a_400(server: ServerProcess) -> None:
    r = HTTP.post(f"{server.url}/v1/completions", json={
        "model": "tiny", "prompt": "hi", "prompt_logprobs": 21}, timeout=30)
    assert r.status_code == 400 and "prompt_logprobs" in r.text


# ---- Responses API -----------------------------------------------------------------------------


def test_responses_text_and_messages(client: OpenAI) -> None:
    out = client.responses.create(model="tiny", input="Tell me a story", max_output_tokens=5,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 5 and out.usage.input_tokens > 3
    assert out.usage.total_tokens == out.usage.input_tokens + 5
    assert isinstance(out.output_text, str) and out.output_text
    chat = client.chat.completions.create(
        model="tiny", max_tokens=5, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "system", "content": "be kind"},
                  {"role": "user", "content": "Tell me a story"}])
    same = client.responses.create(
        model="tiny", instructions="be kind", max_output_tokens=5, temperature=0, top_p=0.9,
        extra_body={"ignore_eos": True},
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Tell me a story"}]}])
    assert same.output_text == chat.choices[0].message.content  # the same prompt, greedy
    assert same.usage.input_tokens == chat.usage.prompt_tokens
    # vLLM's extras, as chat takes them: a truncated prompt, one allowed token
    cut = client.responses.create(model="tiny", input="Tell me a story", max_output_tokens=2,
                                  temperature=0, extra_body={"truncate_prompt_tokens": 3,
                                                             "ignore_eos": True})
    assert cut.usage.input_tokens == 3
    forced = client.responses.create(
        model="tiny", input="Tell me a story", max_output_tokens=2, temperature=0,
        extra_body={"ignore_eos": True, "allowed_token_ids": [300]})
    assert forced.output_text == HTTP.post(str(client.base_url).replace("/v1/", "/detokenize"),
                                           json={"tokens": [300, 300]}).json()["prompt"]
    r = HTTP.post(str(client.base_url) + "responses", json={"input": "a", "bad_words": [" "]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words"  # tokenized


def test_responses_streamed(client: OpenAI) -> None:
    events = list(client.responses.create(model="tiny", input="Tell me a story",
                                          max_output_tokens=6, temperature=0, stream=True,
                                          extra_body={"ignore_eos": True}))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == events[-4].text and final.usage.output_tokens == 6
    whole = client.responses.create(model="tiny", input="Tell me a story", max_output_tokens=6,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert whole.output_text == deltas


def test_responses_refuses_what_it_cannot_do(server: ServerProcess) -> None:
    for extra, field in [({"tools": [{"type": "function", "name": "f"}]}, "tools"),
                         ({"previous_response_id": "resp_1"}, "previous_response_id"),
                         ({"input": [{"role": "user", "content": [
                             {"type": "input_image", "image_url": "x"}]}]}, "input")]:
        body = {"model": "tiny", "input": "hi", **extra}
        r = HTTP.post(f"{server.url}/v1/responses", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


# ---- chat role chunk, HEAD, metrics ------------------------------------------------------------


def test_chat_role_chunk_comes_with_each_choices_first_token(server: ServerProcess) -> None:
    """The role chunk is sent right before a choice's first token (not at submit): with n=2
    each choice's role chunk is directly followed by that choice's first content."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 2,
            "max_tokens": 4, "stream": True, "ignore_eos": True, "seed": 1}
    with HTTP.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    seen: set[int] = set()
    for e in events:
        choice = e["choices"][0]
        if choice["index"] not in seen:
            seen.add(choice["index"])
            assert choice["delta"] == {"role": "assistant", "content": ""}
        else:
            assert "role" not in choice["delta"]
    assert seen == {0, 1}
    roles = [i for i, e in enumerate(events) if "role" in e["choices"][0]["delta"]]
    assert all(events[i + 1]["choices"][0]["index"] == events[i]["choices"][0]["index"]
               for i in roles)


def test_head_on_get_endpoints(server: ServerProcess) -> None:
    for path in ("/health", "/metrics", "/v1/models", "/v1/models/tiny", "/server_info"):
        get = HTTP.get(f"{server.url}{path}", timeout=30)
        head = httpx.head(f"{server.url}{path}", timeout=30)
        assert head.status_code == get.status_code == 200, path
        assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"]
    assert httpx.head(f"{server.url}/nope", timeout=30).status_code == 404


def test_vllm_named_metrics(server: ServerProcess, client: OpenAI) -> None:
    before = metric_values(server.url)
    client.completions.create(model="tiny", prompt="hello there", max_tokens=4, temperature=0,
                              extra_body={"ignore_eos": True})
    after = metric_values(server.url)

    def moved(name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    assert moved("vllm:generation_tokens_total") >= 4
    assert moved("vllm:prompt_tokens_total") >= 2
    assert moved("vllm:request_success_total", (("finished_reason", "length"),)) == 1
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens",
                 "request_time_per_output_token_seconds"):
        assert moved(f"vllm:{hist}_count") == 1, hist
    assert moved("vllm:inter_token_latency_seconds_count") == 3
    assert moved("vllm:time_per_output_token_seconds_count") == 3
    assert moved("vllm:request_generation_tokens_sum") == 4
    assert moved("vllm:iteration_tokens_total_count") >= 4  # one prefill + 3 decode steps
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                  "gpu_cache_usage_perc"):
        assert ("vllm:" + gauge, ()) in after, gauge
    assert ("vllm:prefix_cache_queries_total", ()) in after
    assert ("vllm:prefix_cache_hits_total", ()) in after
    assert ("vllm:num_preemptions_total", ()) in after
    info = [k for k in after if k[0] == "vllm:cache_config_info"]
    assert len(info) == 1 and dict(info[0][1])["block_size"] == "1"
    assert int(dict(info[0][1])["num_gpu_blocks"]) > 0
