"""Processes for the router tests: engine replicas (`banyan serve`, tiny model, one thread each)
started in parallel, and `banyan route` processes; each in its own process group, so stopping one
reaps all its processes."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tests.server_helpers import ServerProcess, free_port, spawn, wait_ready
from tests.http_client import HTTP

# Two running requests at most: the tiny model decodes a token in about a millisecond, so
# without a queue no request would stay in flight long enough to be seen (load, failover).
REPLICA_ARGS = ("--dtype", "float32", "--kv-cache-memory", "32MiB", "--num-threads", "1",
                "--max-running-requests", "2", "--log-level", "warning")


def start_processes(cmds: Sequence[tuple[list[str], int, str]], log_dir: Path,
                    ready_path: str, hosts: Sequence[str] = ()) -> list[ServerProcess]:
    """Start all (at hosts[i], default localhost), then wait for all; on failure, stop what was
    started."""
    procs: list[ServerProcess] = []
    try:
        for i, (cmd, port, name) in enumerate(cmds):
            procs.append(spawn(cmd, port, log_dir, name, *hosts[i:i + 1]))
        wait_ready(procs, ready_path)
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
