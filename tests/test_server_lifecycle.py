"""A second server, with --api-key and --overlap on: 401 without the key; then its engine process
is killed: requests fail fast with 503, an open stream ends with an error event, /health says 503,
and SIGTERM still shuts the server down cleanly."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai import OpenAI

from tests.server_helpers import ServerProcess, sse_events, start_server
from tests.http_client import HTTP

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # overlap on: the engine process's loop runs the overlapped pipeline here
    srv = start_server(llama_dir, tmp_path_factory.mktemp("server-lifecycle"),
                       "--api-key", KEY, "--overlap", "on")
    try:
        yield srv
    finally:
        srv.stop()


def test_api_key(server: ServerProcess) -> None:
    body = {"prompt": "a", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = HTTP.post(f"{server.url}/v1/completions", json=body, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == 401
    assert HTTP.get(f"{server.url}/v1/models").status_code == 401
    assert HTTP.get(f"{server.url}/server_info").status_code == 401
    assert HTTP.get(f"{server.url}/health").status_code == 200  # monitoring stays open
    assert HTTP.get(f"{server.url}/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    client = OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    model = client.models.list().data[0].id  # default name: the --model argument
    assert client.completions.create(model=model, prompt="a", max_tokens=2).choices


def server_model(server: ServerProcess) -> str:
    return HTTP.get(f"{server.url}/v1/models", headers=AUTH).json()["data"][0]["id"]


def test_engine_death_fails_fast(server: ServerProcess) -> None:
    engine_pid = HTTP.get(f"{server.url}/server_info", headers=AUTH).json()["engine_pid"]
    assert engine_pid != server.proc.pid
    long = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with HTTP.stream("POST", f"{server.url}/v1/completions", json=long, headers=AUTH,
                      timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ") and next(lines) == ""
        os.kill(engine_pid, signal.SIGKILL)
        t0 = time.monotonic()
        rest = sse_events(lines)
        assert time.monotonic() - t0 < 5
    # The open stream ends with an error event and [DONE] (no hang).
    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])["error"]
    assert error["code"] == 503
    t0 = time.monotonic()
    r = HTTP.post(f"{server.url}/v1/completions", json={"prompt": "a", "max_tokens": 2},
                   headers=AUTH, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == 503
    r = HTTP.post(f"{server.url}/v1/chat/completions", headers=AUTH, timeout=10, json={
        "messages": [{"role": "user", "content": "a"}], "stream": True})
    assert r.status_code == 503
    assert time.monotonic() - t0 < 2
    health = HTTP.get(f"{server.url}/health")
    assert health.status_code == 503 and "engine" in health.json()["error"]["message"]
    with pytest.raises(openai.InternalServerError):
        OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0).completions.create(
            model=server_model(server), prompt="a", max_tokens=1)
    # The API server still answers what needs no engine, and stops cleanly on SIGTERM.
    assert HTTP.get(f"{server.url}/metrics").status_code == 200
    t0 = time.monotonic()
    assert server.stop() == 0
    assert time.monotonic() - t0 < 20
