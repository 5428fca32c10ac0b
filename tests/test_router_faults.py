"""Issue #14, the router under attack and faults: worker registration without the admin key,
with the API key, from a web page, as text/plain; JSON errors for what the router answers
itself; a hung (SIGSTOPped) replica out of rotation within 3 s with no request waiting longer
than --worker-timeout; a killed `serve --dp` replica started again.

Real processes on 127.0.0.1 (the tiny llama); bounded in count and time.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from tests.router_helpers import (
    start_processes,
    start_replicas,
    stop_all,
    wait_for,
    worker_states,
)
from tests.server_helpers import ServerProcess, free_port
from tests.http_client import HTTP

USER, ADMIN = "sk-user", "sk-admin"
WORKER_TIMEOUT = 5.0


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("router-faults")


@pytest.fixture(scope="module")
def replicas(llama_dir: Path, log_dir: Path) -> Iterator[list[ServerProcess]]:
    procs = start_replicas(llama_dir, log_dir, 2)
    try:
        yield procs
    finally:
        stop_all(procs)


def router_process(workers: list[str], log_dir: Path, *extra: str) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, "-m", "banyan.cli", "route", "--port", str(port), "--log-level",
           "warning", "--health-check-interval", "0.5", *extra]
    for w in workers:
        cmd += ["--worker", w]
    return start_processes([(cmd, port, "router")], log_dir, "/health")[0]


@pytest.fixture(scope="module")
def keyed(replicas: list[ServerProcess], log_dir: Path) -> Iterator[ServerProcess]:
    """API key and admin key; round robin, so a hung worker is sure to be picked. Two failed
    checks take a worker out: with a 0.5 s interval and a 0.75 s check timeout that is at most
    ~2.1 s after it hangs (the default 1 s timeout made it 2.55 s, and a loaded 2-core machine
    added 0.6 s past the 3 s bound)."""
    proc = router_process([r.url for r in replicas], log_dir, "--api-key", USER,
                          "--admin-api-key", ADMIN, "--policy", "round_robin",
                          "--worker-timeout", str(WORKER_TIMEOUT),
                          "--health-check-timeout", "0.75")
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.log()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# ---- worker registration -------------------------------------------------------------------


def test_registration_refused_without_admin_key_configured(replicas: list[ServerProcess],
                                                           log_dir: Path) -> None:
    proc = router_process([replicas[0].url], log_dir)
    try:
        r = HTTP.post(f"{proc.url}/workers", json={"url": replicas[1].url})
        assert r.status_code == 403 and r.json()["error"]["code"] == 403
        r = HTTP.request("DELETE", f"{proc.url}/workers", params={"url": replicas[0].url})
        assert r.status_code == 403
        assert list(worker_states(proc.url)) == [replicas[0].url]
    finally:
        assert proc.stop() == 0


def test_open_admin_refuses_browsers_and_plain_text(replicas: list[ServerProcess],
                                                    log_dir: Path) -> None:
    proc = router_process([replicas[0].url], log_dir, "--allow-admin-without-key")
    new = {"url": replicas[1].url}
    try:
        # What a page in the user's browser can send without a preflight: text/plain.
        r = HTTP.post(f"{proc.url}/workers", content=f'{{"url": "{replicas[1].url}"}}',
                       headers={"Content-Type": "text/plain"})
        assert r.status_code == 415 and r.json()["error"]["code"] == 415
        for headers in ({"Origin": "https://evil.example"}, {"Origin": proc.url},
                        {"Sec-Fetch-Site": "cross-site"}):
            r = HTTP.post(f"{proc.url}/workers", json=new, headers=headers)
            assert r.status_code == 403, (headers, r.text)
        assert list(worker_states(proc.url)) == [replicas[0].url]
        assert HTTP.post(f"{proc.url}/workers", json=new).status_code == 200  # a script
    finally:
        assert proc.stop() == 0


def test_admin_key_separate_from_api_key(keyed: ServerProcess,
                                         replicas: list[ServerProcess]) -> None:
    victim = replicas[1].url
    for headers in ({}, bearer(USER), bearer("wrong")):
        r = HTTP.request("DELETE", f"{keyed.url}/workers", params={"url": victim},
                          headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
    assert HTTP.get(f"{keyed.url}/workers").status_code == 401
    assert len(HTTP.get(f"{keyed.url}/workers", headers=bearer(USER)).json()["workers"]) == 2
    r = HTTP.post(f"{keyed.url}/workers", json={"url": victim},
                   headers={"Authorization": f"bearer {ADMIN}"})  # any case of the scheme
    assert r.status_code == 200 and r.json()["state"] == "healthy"


# ---- errors in OpenAI's shape ------------------------------------------------------------------


def test_router_errors_are_json(keyed: ServerProcess) -> None:
    auth = bearer(USER)
    cases = [
        ("POST", "/v1/chat/completions", b'{"messages": [{"role": "u", "content": '
                                         b'[{"type": "text", "text": 5}]}]}'),
        ("POST", "/v1/completions", b'{"prompt": [[1, 2], "x"]}'),
        ("POST", "/generate", b'{"input_ids": [1e400]}'),
        ("POST", "/v1/completions", b"[" * 50_000 + b"]" * 50_000),
        ("POST", "/v1/completions", b"\xff\xfe not json"),
        ("GET", "/no/such/path", b""),
        ("DELETE", "/v1/completions", b""),
    ]
    for method, path, body in cases:
        r = HTTP.request(method, f"{keyed.url}{path}", content=body, timeout=30,
                          headers={**auth, "Content-Type": "application/json"})
        assert 400 <= r.status_code < 500, (path, body[:40], r.status_code, r.text)
        assert r.json()["error"]["code"] == r.status_code


# ---- a hung replica ----------------------------------------------------------------------------


def test_sigstopped_replica_dropped_fast(keyed: ServerProcess,
                                         replicas: list[ServerProcess]) -> None:
    """SIGSTOP one replica: out of rotation within 3 s; requests sent meanwhile all succeed,
    none waiting longer than --worker-timeout (those on the hung worker fail over); SIGCONT
    brings it back."""
    hung = replicas[0]
    auth = bearer(USER)
    body = {"prompt": "hello", "max_tokens": 4, "ignore_eos": True}

    def timed(i: int) -> tuple[int, float]:
        t0 = time.monotonic()
        r = HTTP.post(f"{keyed.url}/v1/completions", json={**body, "prompt": f"hi {i}"},
                       headers=auth, timeout=60)
        return r.status_code, time.monotonic() - t0

    os.kill(hung.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with ThreadPoolExecutor(6) as pool:
            sent = [pool.submit(timed, i) for i in range(6)]

            def out() -> bool:
                states = HTTP.get(f"{keyed.url}/workers", headers=auth).json()["workers"]
                return any(w["url"] == hung.url and not w["healthy"] for w in states)

            # (polled while the requests run: the time is the router's, not the requests')
            wait_for(out, timeout=10, what="hung worker out of rotation")
            dropped = time.monotonic() - t0
            results = [f.result() for f in sent]
        assert dropped <= 3.0, dropped
        assert [s for s, _ in results] == [200] * 6, results
        assert max(d for _, d in results) <= WORKER_TIMEOUT, results
    finally:
        os.kill(hung.proc.pid, signal.SIGCONT)
    wait_for(lambda: worker_states_auth(keyed.url)[hung.url]["healthy"], timeout=10,
             what="worker back")


def worker_states_auth(url: str) -> dict[str, dict]:
    workers = HTTP.get(f"{url}/workers", headers=bearer(USER)).json()["workers"]
    return {w["url"]: w for w in workers}


# ---- serve --dp: a dead replica is started again -----------------------------------------------


def test_dp_replica_restarted(llama_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "banyan.cli", "serve", "--dp", "2", "--model", str(llama_dir),
           "--port", str(port), "--dtype", "float32", "--kv-cache-memory", "32MiB",
           "--num-threads", "2", "--log-level", "warning", "--engine-restart-backoff", "0.2"]
    (proc,) = start_processes([(cmd, port, "dp")], tmp_path, "/health")
    try:
        workers = worker_states(proc.url)
        victim_url = next(iter(workers))
        victim_port = victim_url.rsplit(":", 1)[1]
        (victim,) = [c for c in psutil.Process(proc.proc.pid).children()
                     if victim_port in c.cmdline()]
        victim.kill()
        # The router's own record that it took the replica out (its warning, in the log), not
        # a sight of the "unhealthy" state: that lasts only until the restart answers, and a
        # poll of a loaded machine once missed it (timed out in the full suite).
        wait_for(lambda: f"worker {victim_url} failed" in proc.log(), timeout=30,
                 what="dead replica out")
        wait_for(lambda: worker_states(proc.url)[victim_url]["healthy"], timeout=90,
                 what="replica restarted")
        r = HTTP.post(f"{victim_url}/v1/completions", timeout=30,
                       json={"prompt": "a", "max_tokens": 2})
        assert r.status_code == 200, r.text
    finally:
        code = proc.stop()
    assert code == 0, proc.log()
