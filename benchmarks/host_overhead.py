"""Host overhead of the engine loop, overlap on and off side by side.

A tiny model (2 layers, hidden 64) keeps the forward short, so what is measured is the host's
own work per step: scheduling, input preparation, output processing (tokens to requests, text,
frees). RUNNING requests decode together; only steady decode steps (every request decoding) are
counted. The two modes alternate REPS times in one process, each on a fresh Engine.

    python benchmarks/host_overhead.py [--running 256] [--steps 100] [--reps 3] [--out FILE]

Per step (medians over the counted steps, then the median run): schedule, prepare, output,
forward (the worker's forward + sampling of the step collected in that turn), host = schedule
+ prepare + output, wall (one engine.step()), idle = 1 - forward / wall, and for overlap the
ratio wall / max(forward, host) (1.0 = the two fully overlap).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from banyan import Engine, SamplingParams
from banyan.bench.offline import command_line, machine_info
from banyan.demo import build_random_model

PHASES = ("schedule", "prepare", "output", "forward", "host", "wall")


def one_run(model: Path, overlap: bool, running: int, steps: int) -> dict[str, float]:
    with Engine(str(model), dtype="float32", device="cpu", disable_tqdm=True,
                max_running_requests=running, max_prefill_tokens=16384,
                chunked_prefill_size=16384, kv_cache_memory="256MiB",
                overlap="on" if overlap else "off") as engine:
        params = SamplingParams(max_new_tokens=steps + 40, temperature=0.0, ignore_eos=True)
        for i in range(running):
            engine.add_request(input_ids=[3 + (i * 7 + j) % 500 for j in range(32)],
                               params=params, request_id=f"r{i}")
        rows: dict[str, list[float]] = {p: [] for p in PHASES}
        for _ in range(steps + 20):
            t0 = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - t0
            s = engine.core.last_step
            if s.num_reqs != running or s.num_tokens != running or not s.timings:
                continue  # prefill, or the first turn (nothing collected yet)
            forward = s.timings.get("forward", 0.0) + s.timings.get("sample", 0.0)
            host = s.schedule + s.launch + s.output
            for name, value in zip(PHASES, (s.schedule, s.launch, s.output, forward, host, wall)):
                rows[name].append(value * 1e3)
        engine.core.abort_all()
    med = {f"{p}_ms": statistics.median(v[-steps:]) for p, v in rows.items()}
    med["steps"] = len(rows["wall"][-steps:])
    med["idle_fraction"] = max(0.0, 1 - med["forward_ms"] / med["wall_ms"])
    med["wall_over_max"] = med["wall_ms"] / max(med["forward_ms"], med["host_ms"])
    return med


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_random_model(Path(tmp) / "tiny", "llama", tokenizer_vocab=512,
                                   tokenizer_corpus_bytes=200_000, hidden_size=64,
                                   intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=1024)
        runs: dict[str, list[dict[str, float]]] = {"overlap": [], "sequential": []}
        for _ in range(ns.reps):
            for mode in ("sequential", "overlap"):
                runs[mode].append(one_run(model, mode == "overlap", ns.running, ns.steps))
    result: dict[str, Any] = {"command": command_line(),
                              "machine": machine_info(), "running": ns.running,
                              "steps": ns.steps, "reps": ns.reps, "runs": runs}
    for mode, rs in runs.items():
        result[mode] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
    seq, ovl = result["sequential"], result["overlap"]
    result["step_speedup"] = seq["wall_ms"] / ovl["wall_ms"]
    print(f"{'':12}" + "".join(f"{p:>11}" for p in PHASES) + f"{'idle':>8}{'wall/max':>10}")
    for mode in ("sequential", "overlap"):
        r = result[mode]
        print(f"{mode:12}" + "".join(f"{r[p + '_ms']:>11.3f}" for p in PHASES)
              + f"{r['idle_fraction']:>8.2f}{r['wall_over_max']:>10.2f}")
    print(f"overlap step speed-up: {result['step_speedup']:.2f}x")
    if ns.out:
        Path(ns.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
