"""Bad requests get OpenAI-shaped errors with the right status (400, not FastAPI's 422; 404 for
an unknown model; 413 past the body limit), and the server keeps serving after each."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from tests.server_helpers import ServerProcess, start_server
from tests.http_client import HTTP

MAX_BYTES = 64 * 1024
MAX_N = 4


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(llama_dir, tmp_path_factory.mktemp("server-errors"),
                       "--served-model-name", "tiny", "--max-request-bytes", str(MAX_BYTES),
                       "--max-n", str(MAX_N), "--max-model-len", "256")
    try:
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()


def check_error(response: httpx.Response, status: int, param: str | None = None,
                contains: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if contains is not None:
        assert contains in error["message"], error["message"]
    return error


def still_serving(url: str) -> None:
    r = HTTP.post(f"{url}/v1/completions",
                   json={"model": "tiny", "prompt": "ok", "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


COMPLETION_CASES: dict[str, tuple[dict[str, Any], int, str | None, str | None]] = {
    # name: (body, status, param, text in the message)
    "missing prompt": ({"model": "tiny"}, 400, "prompt", None),
    "temperature < 0": ({"prompt": "a", "temperature": -1}, 400, "temperature", None),
    "top_p = 0": ({"prompt": "a", "top_p": 0}, 400, "top_p", None),
    "top_k < -1": ({"prompt": "a", "top_k": -5}, 400, "top_k", None),
    "min_p > 1": ({"prompt": "a", "min_p": 2}, 400, "min_p", None),
    "n too large": ({"prompt": "a", "n": MAX_N + 1}, 400, "n", str(MAX_N)),
    "n = 0": ({"prompt": "a", "n": 0}, 400, "n", None),
    "max_tokens < 0": ({"prompt": "a", "max_tokens": -1}, 400, "max_tokens", None),
    "max_tokens past the context": ({"prompt": "a", "max_tokens": 1000}, 400, "max_tokens",
                                    "256"),
    "prompt past the context": ({"prompt": [5] * 256}, 400, "prompt", "256"),
    "token id out of vocab": ({"prompt": [1, 2, 99999]}, 400, "prompt", "99999"),
    "bool as token id": ({"prompt": [True, 2]}, 400, "prompt", None),
    "empty prompt": ({"prompt": ""}, 400, "prompt", None),
    "empty prompt list": ({"prompt": []}, 400, "prompt", None),
    "logprobs > 20": ({"prompt": "a", "logprobs": 21}, 400, "logprobs", None),
    "bad logit_bias key": ({"prompt": "a", "logit_bias": {"x": 1}}, 400, "logit_bias", None),
    "logit_bias id out of vocab": ({"prompt": "a", "logit_bias": {"99999": 1}}, 400, None,
                                   "99999"),
    "presence_penalty > 2": ({"prompt": "a", "presence_penalty": 3}, 400, "presence_penalty",
                             None),
    "repetition_penalty 0": ({"prompt": "a", "repetition_penalty": 0}, 400,
                             "repetition_penalty", None),
    "min_tokens > max_tokens": ({"prompt": "a", "max_tokens": 2, "min_tokens": 5}, 400,
                                "min_tokens", None),
    "stop_token_ids out of vocab": ({"prompt": "a", "stop_token_ids": [99999]}, 400, None,
                                    "99999"),
    "empty stop string": ({"prompt": "a", "stop": [""]}, 400, "stop", None),
    "stream_options without stream": ({"prompt": "a", "stream_options": {
        "include_usage": True}}, 400, "stream_options", None),
    "wrong type": ({"prompt": "a", "max_tokens": "many"}, 400, "max_tokens", None),
    "unknown model": ({"model": "gpt-9", "prompt": "a"}, 404, "model", "gpt-9"),
}


@pytest.mark.parametrize("case", list(COMPLETION_CASES))
def test_completion_errors(server: ServerProcess, case: str) -> None:
    body, status, param, contains = COMPLETION_CASES[case]
    body = {"model": "tiny", **body} if "model" not in body else body
    for stream in (False, True):  # validation happens before a stream starts: same answer
        r = HTTP.post(f"{server.url}/v1/completions", json={**body, "stream": stream}
                       if case != "stream_options without stream" else body)
        check_error(r, status, param, contains)
    still_serving(server.url)


CHAT_CASES: dict[str, tuple[dict[str, Any], int, str | None]] = {
    "no messages": ({"messages": []}, 400, "messages"),
    "message without role": ({"messages": [{"content": "hi"}]}, 400, "messages"),
    "top_logprobs without logprobs": ({"top_logprobs": 2}, 400, "top_logprobs"),
    "top_logprobs > 20": ({"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    "image content": ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages"),
    "max_completion_tokens past the context": ({"max_completion_tokens": 300}, 400,
                                               "max_completion_tokens"),
    "max_tokens past the context": ({"max_tokens": 300}, 400, "max_tokens"),
    "conversation past the context": ({"messages": [{"role": "user", "content": "word " * 400}]},
                                      400, "messages"),
}


@pytest.mark.parametrize("case", list(CHAT_CASES))
def test_chat_errors(server: ServerProcess, case: str) -> None:
    body, status, param = CHAT_CASES[case]
    request = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **body}
    check_error(HTTP.post(f"{server.url}/v1/chat/completions", json=request), status, param)
    still_serving(server.url)


def test_malformed_bodies(server: ServerProcess) -> None:
    url = f"{server.url}/v1/completions"
    check_error(HTTP.post(url, content=b"{not json", headers={"content-type":
                                                                "application/json"}), 400)
    check_error(HTTP.post(url, content=b"[1, 2]"), 400)
    check_error(HTTP.post(url, content=b"\xff\xfe"), 400)
    big = {"model": "tiny", "prompt": "x" * (MAX_BYTES + 1)}
    check_error(HTTP.post(url, json=big), 413)

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit holds while reading
        yield b'{"prompt": "'
        for _ in range(MAX_BYTES // 1024 + 1):
            yield b"y" * 1024
        yield b'"}'

    check_error(HTTP.post(url, content=chunked()), 413)
    check_error(HTTP.get(f"{server.url}/no/such/path"), 404)
    check_error(HTTP.get(url), 405)
    check_error(HTTP.post(f"{server.url}/detokenize", json={"tokens": [99999]}), 400, "tokens")
    check_error(HTTP.post(f"{server.url}/tokenize", json={}), 400)
    check_error(HTTP.post(f"{server.url}/generate", json={"sampling_params": {}}), 400)
    check_error(HTTP.post(f"{server.url}/generate", json={
        "text": "a", "sampling_params": {"temperature": -2}}), 400, "sampling_params")
    check_error(HTTP.get(f"{server.url}/v1/models/gpt-9"), 404)
    still_serving(server.url)


def test_openai_client_exceptions(server: ServerProcess) -> None:
    client = OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt="a", temperature=-1)
    assert bad.value.status_code == 400 and bad.value.param == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "a"}])
    with pytest.raises(openai.BadRequestError) as ctx:
        client.completions.create(model="tiny", prompt=[7] * 300, max_tokens=1)
    assert "256" in ctx.value.message
    with pytest.raises(openai.BadRequestError):  # a streamed request fails before streaming
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "a"}], stream=True, n=MAX_N + 1)
    assert client.completions.create(model="tiny", prompt="a", max_tokens=1).choices
