"""Processes for the router tests: engine replicas (`banyan serve`, tiny model, one thread each)
started in parallel, and `banyan route` processes; each in its own process group, so stopping one
reaps all its processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from tests.server_helpers import START_TIMEOUT, ServerProcess, free_port
from tests.http_client import HTTP

# Two running requests at most: the tiny model decodes a token in about a millisecond, so
# without a queue no request would stay in flight long enough to be seen (load, failover).
REPLICA_ARGS = ("--dtype", "float32", "--kv-cache-memory", "32MiB", "--num-threads", "1",
                "--max-running-requests", "2", "--log-level", "warning")


def _spawn(cmd: list[str], port: int, log_dir: Path, name: str,
           host: str = "127.0.0.1") -> ServerProcess:
    log_path = log_dir / f"{name}-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return ServerProcess(proc, port, log_path, host)


def _wait(procs: Sequence[ServerProcess], path: str, timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    pending = list(procs)
    while pending:
        for p in list(pending):
            if p.proc.poll() is not None:
                raise RuntimeError(f"process exited with {p.proc.returncode}:\n{p.log()}")
            try:
                if HTTP.get(f"{p.url}{path}", timeout=1.0).status_code == 200:
                    pending.remove(p)
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"not up in {timeout} s:\n" + "\n".join(p.log() for p in pending))
        time.sleep(0.1)


def start_processes(cmds: Sequence[tuple[list[str], int, str]], log_dir: Path,
                    ready_path: str, hosts: Sequence[str] = ()) -> list[ServerProcess]:
    """Start all (at hosts[i], default localhost), then wait for all; on failure, stop what was
    started."""
    procs: list[ServerProcess] = []
    try:
        for i, (cmd, port, name) in enumerate(cmds):
            procs.append(_spawn(cmd, port, log_dir, name, *hosts[i:i + 1]))
        _wait(procs, ready_path)
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs


def stop_all(procs: Sequence[ServerProcess]) -> list[int]:
    """SIGTERM to all first (they shut down in parallel), then reap each; exit codes."""
    for p in procs:
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGTERM)
    return [p.stop() for p in procs]


def start_replicas(model_dir: Path, log_dir: Path, n: int) -> list[ServerProcess]:
    cmds = []
    for _ in range(n):
        port = free_port()
        cmds.append(([sys.executable, "-m", "banyan.cli", "serve", "--model", str(model_dir),
                      "--port", str(port), *REPLICA_ARGS], port, "replica"))
    return start_processes(cmds, log_dir, "/health")


def start_router(workers: Sequence[str], log_dir: Path, *extra: str) -> ServerProcess:
    port = free_port()
    # The tests change workers with plain httpx (no Origin header), as an admin script would.
    cmd = [sys.executable, "-m", "banyan.cli", "route", "--port", str(port),
           "--health-check-interval", "0.5", "--log-level", "warning",
           "--allow-admin-without-key", *extra]
    for w in workers:
        cmd += ["--worker", w]
    return start_processes([(cmd, port, "router")], log_dir, "/workers")[0]


def worker_states(router_url: str) -> dict[str, dict]:
    return {w["url"]: w for w in HTTP.get(f"{router_url}/workers").json()["workers"]}


def wait_for(predicate: object, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
