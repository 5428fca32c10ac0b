"""Grammar cost: decode step time with a JSON schema vs without, at batch 1 and 64, side by
side in one run (rounds alternate plain / json so machine noise hits both alike).

    python benchmarks/structured_cost.py --model DIR [--rounds 3] [--tokens 16] \
        [--out benchmarks/results/structured-cost.json]

The schema is an object with one free string, so a random-weight model stays inside the grammar
for every measured step (its mask is the full-vocabulary string class, the costliest kind to
fill). Steps are timed around Engine.step(); only decode steps holding the whole batch count.
Targets (issue 15): json / plain <= 1.05 at batch 1 and <= 1.10 at batch 64.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from banyan.bench.offline import machine_info
from banyan.engine.offline import Engine
from banyan.sampling.params import SamplingParams
from banyan.structured.spec import json_schema_spec

SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"],
          "additionalProperties": False}


def decode_steps(engine: Engine, batch: int, tokens: int, structured: bool,
                 round_: int) -> list[float]:
    spec = json_schema_spec(SCHEMA, "schema") if structured else None
    for i in range(batch):
        params = SamplingParams(max_new_tokens=tokens, temperature=1.0, seed=round_ * 1000 + i,
                                ignore_eos=True, structured=spec)
        engine.add_request(f"Write JSON {round_} {i}:", params)
    times = []
    while engine.core.has_work:
        t0 = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - t0
        last = engine.core.last_step
        if last.num_reqs == batch and last.num_tokens == batch:
            times.append(elapsed)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--note", default="", help="how busy the machine was, for the record")
    ns = ap.parse_args()
    results = {}
    with Engine(ns.model, dtype="float32", disable_tqdm=True, kv_cache_memory="1GiB") as engine:
        decode_steps(engine, 2, 4, True, -1)  # warm-up: kernels, the grammar compiled
        for batch in (int(b) for b in ns.batches.split(",")):
            steps: dict[str, list[float]] = {"plain": [], "json": []}
            for r in range(ns.rounds):
                for mode in ("plain", "json") if r % 2 == 0 else ("json", "plain"):
                    steps[mode] += decode_steps(engine, batch, ns.tokens, mode == "json", r)
            plain, js = statistics.median(steps["plain"]), statistics.median(steps["json"])
            results[f"batch_{batch}"] = {
                "plain_step_ms": round(plain * 1e3, 2), "json_step_ms": round(js * 1e3, 2),
                "ratio": round(js / plain, 3),
                "steps_measured": {k: len(v) for k, v in steps.items()}}
            print(batch, results[f"batch_{batch}"], flush=True)
    report = {"benchmark": "structured-output grammar cost (decode step, median)",
              "command": "python " + " ".join(sys.argv[:1] + [
                  a if not a.startswith("/") else Path(a).name for a in sys.argv[1:]]),
              "model": Path(ns.model).name, "schema": SCHEMA, "dtype": "float32",
              "machine": machine_info(), "note": ns.note,
              "results": results}
    text = json.dumps(report, indent=2)
    print(text)
    if ns.out:
        ns.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
