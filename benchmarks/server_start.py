"""Time `banyan serve` from launch to /health answering, and from SIGTERM to the server's exit
and to its last process gone, for each model and each source tree, trees alternating round by
round (so two builds are compared side by side in one run).

    python benchmarks/server_start.py --model default --model DIR [--tree A --tree B]
        [--rounds 3] [--out benchmarks/results/server-start-....json]

A tree is a checkout of Banyan (e.g. a `git worktree` of an earlier commit); each server runs
with that tree first on PYTHONPATH and the same interpreter (this one). "default" is the
default model (`serve` with no --model). Every server gets the flags a user would give none of,
except --port and --log-level.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from banyan.bench.offline import cpu_label, machine_info
from banyan.router.launch import free_port

_CLIENT = httpx.Client(timeout=1.0, limits=httpx.Limits(max_keepalive_connections=0))


def _group_alive(pgid: int) -> bool:
    """Whether any process of the group is left (zombies count: a supervisor that waits for
    the group sees them)."""
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def one_start(tree: Path, model: str, timeout: float = 180.0) -> dict[str, float]:
    port = free_port()
    cmd = [sys.executable, "-m", "banyan.cli", "serve", "--port", str(port), "--log-level",
           "warning", *([] if model == "default" else ["--model", model])]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd} exited with {proc.returncode}")
            if time.monotonic() - start > timeout:
                raise RuntimeError(f"{cmd} not ready in {timeout} s")
            try:  # (one client: httpx.get would load the CA bundle at each poll, ~95 ms)
                if _CLIENT.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        ready = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        exited = time.monotonic()
        while _group_alive(proc.pid) and time.monotonic() - exited < 30:
            time.sleep(0.01)
        gone = time.monotonic()
    finally:
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return {"ready_s": ready - start, "exit_s": exited - ready, "group_gone_s": gone - ready}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--tree", action="append", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    ns = ap.parse_args()
    trees = [t.resolve() for t in ns.tree or [Path(__file__).resolve().parents[1]]]
    runs: dict[str, dict[str, list[dict[str, float]]]] = {
        str(t): {m: [] for m in ns.model} for t in trees}
    for r in range(ns.rounds):
        for tree in trees if r % 2 == 0 else trees[::-1]:
            for model in ns.model:
                got = one_start(tree, model)
                runs[str(tree)][model].append(got)
                print(f"round {r} {tree.name} {Path(model).name}: " +
                      " ".join(f"{k} {v:.2f}" for k, v in got.items()), flush=True)
    medians = {t: {m: {k: statistics.median(run[k] for run in rs) for k in rs[0]}
                   for m, rs in per_model.items()} for t, per_model in runs.items()}
    home = str(Path.home())
    report = {"command": " ".join(sys.argv).replace(home, "~"), "cpu": cpu_label(machine_info()),
              "medians": medians, "runs": runs}
    text = json.dumps(report, indent=1).replace(home, "~")
    print(json.dumps(medians, indent=1).replace(home, "~"))
    if ns.out is not None:
        ns.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
