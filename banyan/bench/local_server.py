"""A `banyan serve` process on a free localhost port for a benchmark: started the real way (a
subprocess in its own session), waited for until /health answers, stopped with its children."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from banyan.router.launch import free_port


def start_server(serve_args: list[str], log: Path | None = None, timeout: float = 300.0,
                 poll: float = 0.2, tree: Path | None = None,
                 ) -> tuple[subprocess.Popen[bytes], str]:
    """`banyan serve --port <free> *serve_args` -> (the process, its base URL) once /health
    answers 200 (asked every `poll` s); RuntimeError (with the log's tail) if it exits or is
    not up in `timeout`. `tree`: a checkout of Banyan to run instead of the installed one."""
    port = free_port()
    cmd = [sys.executable, "-m", "banyan.cli", "serve", "--port", str(port), *serve_args]
    env = None if tree is None else {**os.environ, "PYTHONPATH": str(tree)}
    with open(log if log is not None else os.devnull, "wb") as out:  # (the child keeps its own)
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=tree, env=env,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    # One client for the polls: httpx.get builds one per call, loading the CA bundle each time
    # (~95 ms of CPU on a Zen 1, taken from the server starting beside it).
    with httpx.Client(timeout=1) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = log.read_text()[-2000:] if log is not None else ""
                raise RuntimeError(f"banyan serve {' '.join(serve_args)} exited: {tail}")
            try:
                if client.get(f"{url}/health").status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                pass
            time.sleep(poll)
    stop_server(proc)
    raise RuntimeError(f"banyan serve {' '.join(serve_args)} not up in {timeout:.0f} s")


def stop_server(proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """SIGTERM to the server's session, SIGKILL if it outlives `timeout`."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
