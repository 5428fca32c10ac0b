"""Server processes for the tests: a real `banyan serve` (API server + engine process) on a free
localhost port, started, waited for and stopped with everything it spawned; and readers of what
it says (SSE events, Prometheus samples, an idle pool). Shared by every test that starts one."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from banyan.router.launch import free_port as launch_free_port
from tests.http_client import HTTP

START_TIMEOUT = 120.0


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free now and not handed out before in this test run (banyan.router.launch's
    free_port: a P/D test's decode worker, given the colocated server's port, failed to bind
    while its health checks reached the other)."""
    port = launch_free_port(taken=_HANDED_OUT)
    _HANDED_OUT.add(port)
    return port


@dataclass
class ServerProcess:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def openai(self) -> OpenAI:
        """An OpenAI client of this server (no retries: a test sees each failure as it is)."""
        return OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then SIGKILL of its process group if it does not exit in time; returns the
        exit code of the server process. Nothing of the group is left running."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        try:  # the engine process is in the same group: it must be gone too
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                os.killpg(self.proc.pid, 0)
                time.sleep(0.1)
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise AssertionError("a process of the server outlived it")
        except ProcessLookupError:
            pass
        return self.proc.returncode


def spawn(cmd: list[str], port: int, log_dir: Path, name: str,
          host: str = "127.0.0.1") -> ServerProcess:
    """Start `cmd` (a server that will listen on host:port) in its own process group, so that
    stopping it can reap everything it spawned; output to log_dir/<name>-<port>.log."""
    log_path = log_dir / f"{name}-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return ServerProcess(proc, port, log_path, host)


def wait_ready(procs: Sequence[ServerProcess], path: str, timeout: float = START_TIMEOUT) -> None:
    """Until GET <path> answers 200 from every process (asked together every 50 ms);
    RuntimeError with the logs if one exits or they are not all up in `timeout`."""
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
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"not up in {timeout} s:\n" + "\n".join(p.log() for p in pending))
        if pending:
            time.sleep(0.05)


def start_server(model_dir: Path, log_dir: Path, *extra: str) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, "-m", "banyan.cli", "serve", "--model", str(model_dir),
           "--port", str(port), "--dtype", "float32", "--kv-cache-memory", "32MiB",
           "--log-level", "warning", *extra]
    server = spawn(cmd, port, log_dir, "server")
    try:
        wait_ready([server], "/health")
    except BaseException:
        server.stop()
        raise
    return server


def sse_events(lines: Iterator[str]) -> list[str]:
    """The `data:` payloads of an SSE body, checking the framing: only `data: ` lines, each
    followed by a blank line, no comments or other fields."""
    events = []
    expect_blank = False
    for line in lines:
        if expect_blank:
            assert line == "", f"event not followed by a blank line: {line!r}"
            expect_blank = False
            continue
        assert line.startswith("data: "), f"unexpected SSE line {line!r}"
        events.append(line[len("data: "):])
        expect_blank = True
    return events


def metric_values(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = HTTP.get(f"{url}/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            values[(sample.name, labels)] = sample.value
    return values


def wait_idle_and_free(url: str, timeout: float = 20.0) -> dict:
    """/server_info once the engine holds no request and every KV slot is free or evictable."""
    deadline = time.monotonic() + timeout
    info: dict = {}
    while time.monotonic() < deadline:
        info = HTTP.get(f"{url}/server_info").json()
        if (info["num_requests"] == 0 and info["kv_protected"] == 0
                and info["kv_free"] + info["kv_evictable"] == info["kv_capacity"]):
            return info
        time.sleep(0.05)
    raise AssertionError(f"engine not idle with a free KV pool: {info}")


@contextlib.contextmanager
def running_server(llama_dir: Path, folder: Path, *extra: str) -> Iterator[ServerProcess]:
    """A tiny-model server serving as "tiny" for the duration; it must exit cleanly."""
    srv = start_server(llama_dir, folder, "--served-model-name", "tiny", *extra)
    try:
        yield srv
    finally:
        code = srv.stop()
        assert code == 0, f"server exit code {code}:\n{srv.log()}"
