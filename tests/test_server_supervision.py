"""Issue #14, the API server under faults: a chat-template bomb from a trusted client, keys
from the environment and in any case, the engine process killed (restarted within 30 s with
/metrics consistent, or the server exits non-zero when told not to restart), and the IPC
directory a killed server leaves behind.

Real processes on 127.0.0.1 (the tiny llama); bounded in count and time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from banyan.server.supervisor import IPC_PREFIX, remove_stale_ipc_dirs
from tests.server_helpers import ServerProcess, metric_values, sse_events, start_server
from tests.test_server_faults import BOMB, HEALTH_BOUND, health_while
from tests.http_client import HTTP

KEY = "sk-env-key"
AUTH = {"Authorization": f"bearer {KEY}"}  # lower-case scheme: accepted


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory,
           ) -> Iterator[ServerProcess]:
    """Trusts request templates (to show the time limit), key from BANYAN_API_KEY, restarts a
    dead engine after 0.2 s."""
    os.environ["BANYAN_API_KEY"] = KEY
    try:
        srv = start_server(llama_dir, tmp_path_factory.mktemp("server-supervision"),
                           "--trust-request-chat-template", "--tokenize-timeout", "2",
                           "--engine-restart-backoff", "0.2")
    finally:
        del os.environ["BANYAN_API_KEY"]
    try:
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()


def test_key_from_environment_any_case(server: ServerProcess) -> None:
    body = {"prompt": "a", "max_tokens": 2}
    assert HTTP.post(f"{server.url}/v1/completions", json=body).status_code == 401
    for scheme in ("bearer", "Bearer", "BEARER"):
        r = HTTP.post(f"{server.url}/v1/completions", json=body, timeout=30,
                       headers={"Authorization": f"{scheme} {KEY}"})
        assert r.status_code == 200, r.text
    assert "sk-env-key" not in " ".join(_cmdline(server.proc.pid))


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_text().split("\0")


def test_template_bomb_stopped_and_health_answers(server: ServerProcess) -> None:
    """A 10000 x 10000 template loop: stopped at --tokenize-timeout (400), /health fast
    meanwhile."""
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}],
                       "chat_template_kwargs": {"chat_template": BOMB}}).encode()
    t0 = time.monotonic()
    r, latencies = health_while(server.url, lambda: HTTP.post(
        f"{server.url}/v1/chat/completions", content=body, timeout=60,
        headers={**AUTH, "Content-Type": "application/json"}))
    assert r.status_code == 400 and "longer than" in r.json()["error"]["message"], r.text
    assert time.monotonic() - t0 < 10
    assert max(latencies) < HEALTH_BOUND, latencies
    # The pool thread is free again: a normal chat works.
    ok = HTTP.post(f"{server.url}/v1/chat/completions", headers=AUTH, timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_request_chat_template_applied_when_trusted(server: ServerProcess) -> None:
    """vLLM's top-level chat_template renders the prompt (here: a fixed text, so the prompt's
    tokens are that text's)."""
    template = "{% for m in messages %}Q: {{ m.content }}\n{% endfor %}A:"
    r = HTTP.post(f"{server.url}/v1/chat/completions", headers=AUTH, timeout=30, json={
        "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 1,
        "chat_template": template})
    assert r.status_code == 200, r.text
    expected = HTTP.post(f"{server.url}/tokenize", headers=AUTH, timeout=30, json={
        "prompt": "Q: hi there\nA:", "add_special_tokens": False}).json()["count"]
    assert r.json()["usage"]["prompt_tokens"] == expected
    counted = HTTP.post(f"{server.url}/tokenize", headers=AUTH, timeout=30, json={
        "messages": [{"role": "user", "content": "hi there"}], "chat_template": template})
    assert counted.json()["count"] == expected  # /tokenize renders what chat would


def _engine_pid(url: str) -> int:
    return HTTP.get(f"{url}/server_info", headers=AUTH, timeout=10).json()["engine_pid"]


def _running(url: str) -> float:
    return metric_values(url)[("banyan:num_requests_running", ())]


def test_engine_killed_is_restarted(server: ServerProcess) -> None:
    """kill -9 of the engine mid-stream: the stream ends with a 503 event, /metrics shows nothing
    running, the dead process is reaped, and the server serves again within 30 s."""
    old = _engine_pid(server.url)
    # long enough that it cannot end before the kill lands, whatever the load (1 to 3 s)
    long = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    errors_before = metric_values(server.url)[  # (read first: the stream must not end first)
        ("banyan:request_success_total", (("finished_reason", "error"),))]
    with HTTP.stream("POST", f"{server.url}/v1/completions", json=long, headers=AUTH,
                      timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ") and next(lines) == ""
        os.kill(old, signal.SIGKILL)
        t0 = time.monotonic()
        rest = sse_events(lines)
    assert json.loads(rest[-2])["error"]["code"] == 503 and rest[-1] == "[DONE]"
    values = metric_values(server.url)
    assert values[("banyan:num_requests_running", ())] == 0
    assert values[("banyan:request_success_total", (("finished_reason", "error"),))] \
        == errors_before + 1
    # Back within 30 s, with a new engine.
    while HTTP.get(f"{server.url}/health").status_code != 200:
        assert time.monotonic() - t0 < 30, server.log()
        time.sleep(0.2)
    assert _engine_pid(server.url) != old
    r = HTTP.post(f"{server.url}/v1/completions", headers=AUTH, timeout=30,
                   json={"prompt": "a", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert _running(server.url) == 0
    # Reaped (no zombie), and the log names the real exit code.
    status = Path(f"/proc/{old}/status")
    assert not status.exists() or "zombie" not in status.read_text()
    assert "exit code -9" in server.log()


def test_no_restart_exits_nonzero(llama_dir: Path, tmp_path: Path) -> None:
    """--max-engine-restarts 0: a dead engine makes the server exit 1 (for systemd & co)."""
    srv = start_server(llama_dir, tmp_path, "--max-engine-restarts", "0")
    try:
        pid = HTTP.get(f"{srv.url}/server_info", timeout=10).json()["engine_pid"]
        os.kill(pid, signal.SIGKILL)
        try:
            code = srv.proc.wait(30)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"server did not exit:\n{srv.log()}") from None
        assert code == 1, srv.log()
    finally:
        srv.stop()


def test_stale_ipc_dirs_removed(tmp_path: Path) -> None:
    """Directories of servers that are gone are removed; a live server's stays."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"{IPC_PREFIX}{dead.pid}-abc"
    live = tmp_path / f"{IPC_PREFIX}{os.getpid()}-def"
    other = tmp_path / "banyan-something-else"
    for d in (stale, live, other):
        d.mkdir()
        (d / "to-engine-1").write_text("")
    assert remove_stale_ipc_dirs(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.exists() and other.exists()

