"""Batch-1 decode on a shared CPU: idle, then beside a competing process, per thread setting.

    python benchmarks/contention.py [--reps 2] [--tokens 96] [--out FILE]

The competitor is a second process running a 2-thread float32 matmul loop (1024 x 1024, torch)
for as long as the measurement lasts, started either in a session of its own (`own`: another
program on the machine, started from another terminal or by a service manager) or in the
benchmark's session (`same`: on kernels with autogroup, the scheduler then shares the CPU per
thread rather than per session, so its two threads take two thirds of the cores from a
one-thread engine). Each configuration runs in a fresh process (the default model, its GGUF
blocks: what `make serve` runs): the default (all cores, fewer while other processes use
some), `fixed-2` (two threads however loaded: the previous default), one thread, and
OMP_WAIT_POLICY / GOMP_SPINCOUNT variants. Per configuration: decode tok/s idle and loaded
(medians over reps, alternating) and loaded / idle. The issue's bar: the default keeps >= 0.4x
of its idle speed under the load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

CONFIGS: dict[str, tuple[dict[str, str], list[str]]] = {
    "default": ({}, []),
    "fixed-2": ({}, ["--threads", "2"]),
    "omp-passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, []),
    "1-thread": ({}, ["--threads", "1"]),
    "spin-1k": ({"GOMP_SPINCOUNT": "1000"}, []),
    "spin-10k": ({"GOMP_SPINCOUNT": "10000"}, []),
    "spin-100k": ({"GOMP_SPINCOUNT": "100000"}, []),
}

COMPETITOR = r"""
import sys, time, torch
torch.set_num_threads(2)
a = torch.randn(1024, 1024)
end = time.time() + float(sys.argv[1])
while time.time() < end:
    a @ a
"""


def worker(tokens: int, threads: int | None) -> None:
    from banyan import Engine
    from banyan.bench.offline import batch1

    kw: dict[str, Any] = {} if threads is None else {"num_threads": threads}
    with Engine(None, kv_cache_memory="256MiB", disable_tqdm=True, **kw) as engine:
        batch1(engine, 32, 16, engine.core.vocab_size)  # warm-up
        result = batch1(engine, 128, tokens, engine.core.vocab_size)
    print(json.dumps({"decode_tok_s": result["decode_tok_s"],
                      "quantization": engine.core.quantization}))


def run_worker(env: dict[str, str], args: list[str], tokens: int) -> float:
    out = subprocess.run([sys.executable, __file__, "--worker", "--tokens", str(tokens), *args],
                         env={**os.environ, **env}, capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["decode_tok_s"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--configs", default="default,fixed-2,1-thread", help="comma-separated: " +
                    ", ".join(CONFIGS))
    ap.add_argument("--competitor-sessions", default="own,same",
                    help="where the competitor runs: own, same (comma-separated)")
    ap.add_argument("--out", default=None)
    ns = ap.parse_args(argv)
    if ns.worker:
        worker(ns.tokens, ns.threads)
        return 0
    from banyan.bench.offline import command_line, machine_info

    chosen = {name: CONFIGS[name] for name in ns.configs.split(",")}
    sessions = ns.competitor_sessions.split(",")
    runs: dict[str, dict[str, list[float]]] = {
        c: {"idle": [], **{f"loaded-{s}": [] for s in sessions}} for c in chosen}
    for _ in range(ns.reps):
        for name, (env, args) in chosen.items():
            runs[name]["idle"].append(run_worker(env, args, ns.tokens))
            for session in sessions:
                competitor = subprocess.Popen([sys.executable, "-c", COMPETITOR, "600"],
                                              start_new_session=session == "own")
                try:
                    time.sleep(2.0)  # the competitor is computing before the engine starts
                    runs[name][f"loaded-{session}"].append(run_worker(env, args, ns.tokens))
                finally:
                    competitor.kill()
                    competitor.wait()
    summary: dict[str, dict[str, float]] = {}
    for name, r in runs.items():
        idle = statistics.median(r["idle"])
        summary[name] = {"idle_tok_s": idle}
        line = f"{name:12s} idle {idle:7.1f}"
        for session in sessions:
            loaded = statistics.median(r[f"loaded-{session}"])
            summary[name][f"loaded_{session}_tok_s"] = loaded
            summary[name][f"loaded_{session}_over_idle"] = loaded / idle
            line += f"  loaded ({session} session) {loaded:7.1f} ({loaded / idle:.2f}x)"
        print(line, flush=True)
    result = {"command": command_line(), "machine": machine_info(),
              "competitor": "2-thread torch matmul loop, 1024 x 1024 float32",
              "runs": runs, "summary": summary}
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
