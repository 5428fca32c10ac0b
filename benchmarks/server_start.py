"""Time `banyan serve` from launch to /health answering, and from SIGTERM to the server's exit
and to its last process gone, for each model and each source tree, trees alternating round by
round (so two builds are compared side by side in one run).

    python benchmarks/server_start.py --model default --model DIR [--tree A --tree B]
        [--rounds 3] [--out benchmarks/results/server-start-....json]

A tree is a checkout of Banyan (e.g. a `git worktree` of an earlier commit); each server runs
with that tree first on PYTHONPATH and the same interpreter (this one). "default" is the
default model (`serve` with no --model). Every server gets the flags a user would give none of,
except --port and --log-level. The report names trees by their commit and models by their
folder's name.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path

from banyan.bench.local_server import start_server
from banyan.bench.offline import cpu_label, machine_info


def _group_alive(pgid: int) -> bool:
    """Whether any process of the group is left (zombies count: a supervisor that waits for
    the group sees them)."""
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def one_start(tree: Path, model: str) -> dict[str, float]:
    args = ["--log-level", "warning", *([] if model == "default" else ["--model", model])]
    start = time.monotonic()
    proc, _ = start_server(args, timeout=180.0, poll=0.02, tree=tree)
    ready = time.monotonic()
    try:
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


def tree_label(tree: Path) -> str:
    """The tree's commit, "+" where its files differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True,
                              check=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + ("+" if git("status", "--porcelain") else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--tree", action="append", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    ns = ap.parse_args()
    trees = {tree_label(t): t.resolve()
             for t in ns.tree or [Path(__file__).resolve().parents[1]]}
    runs: dict[str, dict[str, list[dict[str, float]]]] = {
        label: {Path(m).name: [] for m in ns.model} for label in trees}
    for r in range(ns.rounds):
        for label in list(trees) if r % 2 == 0 else list(trees)[::-1]:
            for model in ns.model:
                got = one_start(trees[label], model)
                runs[label][Path(model).name].append(got)
                print(f"round {r} {label} {Path(model).name}: " +
                      " ".join(f"{k} {v:.2f}" for k, v in got.items()), flush=True)
    medians = {t: {m: {k: statistics.median(run[k] for run in rs) for k in rs[0]}
                   for m, rs in per_model.items()} for t, per_model in runs.items()}
    command = ["benchmarks/server_start.py", *(f"--tree {t}" for t in trees),
               *(f"--model {Path(m).name}" for m in ns.model), f"--rounds {ns.rounds}"]
    report = {"command": " ".join(command), "cpu": cpu_label(machine_info()),
              "medians": medians, "runs": runs}
    print(json.dumps(medians, indent=1))
    if ns.out is not None:
        ns.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
