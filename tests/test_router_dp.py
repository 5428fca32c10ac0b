"""`banyan serve --dp 2`: one command starts two replicas (threads split between them) and the
router in front; SIGTERM stops every process of it."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.router_helpers import start_processes, worker_states
from tests.server_helpers import free_port
from tests.http_client import HTTP


def test_serve_dp(llama_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "banyan.cli", "serve", "--dp", "2", "--model", str(llama_dir),
           "--port", str(port), "--dtype", "float32", "--kv-cache-memory", "32MiB",
           "--num-threads", "2", "--served-model-name", "tiny-dp", "--log-level", "warning",
           "--policy", "round_robin"]
    (proc,) = start_processes([(cmd, port, "dp")], tmp_path, "/health")
    try:
        workers = worker_states(proc.url)
        assert len(workers) == 2 and all(w["state"] == "healthy" for w in workers.values())
        assert all(url.startswith("http://127.0.0.1:") for url in workers)
        for url in workers:  # each replica got half the threads, and the model's name
            info = HTTP.get(f"{url}/server_info").json()
            assert info["engine_args"]["num_threads"] == 1
            assert info["model"] == "tiny-dp"
        assert HTTP.get(f"{proc.url}/workers").json()["policy"] == "round_robin"
        client = OpenAI(base_url=f"{proc.url}/v1", api_key="x", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["tiny-dp"]
        served = set()
        for i in range(4):
            raw = client.completions.with_raw_response.create(
                model="tiny-dp", prompt=f"hello {i}", max_tokens=4)
            assert raw.parse().usage.completion_tokens == 4
            served.add(raw.headers["x-banyan-worker"])
        assert served == set(workers)  # round robin over both
    finally:
        code = proc.stop()  # also asserts that no process of the group outlived it
    assert code == 0, proc.log()
    for url in workers:
        try:
            HTTP.get(f"{url}/health", timeout=1.0)
            raise AssertionError(f"replica {url} still answers")
        except httpx.ConnectError:
            pass


def test_replicas_get_distinct_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    """bind(0) can hand a just-closed port out again: free_port skips the ones already taken
    (two replicas given one port: the later fails to bind, the earlier answers for both)."""
    from banyan.router import launch

    handed = iter([41000, 41000, 41000, 41001])

    class OnePortAgain:
        def __enter__(self) -> OnePortAgain:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def bind(self, address: tuple[str, int]) -> None:
            self.port = next(handed)

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(launch.socket, "socket", lambda *args: OnePortAgain())
    first = launch.free_port()
    assert (first, launch.free_port(taken=[first])) == (41000, 41001)
