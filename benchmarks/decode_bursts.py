"""Bursts of decode steps (`--num-scheduler-steps`) against one step at a time, side by side.

For each weight format, two engines in one process (bursts of up to 8 steps, and 1), the
default model's weights; rounds alternate the two, each round one batch-1 128/128 request per
engine (decode tok/s) and, with --batched, random 64 x 128/128 (output tok/s, where a step of 64
decodes takes ~30 ms and so runs alone: the ratio should be ~1). Ratios are per round, burst
over single, then their median.

    python benchmarks/decode_bursts.py [--configs none,int8,int4] [--rounds 5] [--batched]
                                       [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from banyan import Engine
from banyan.bench.offline import batch1, command_line, machine_info, run_workload
from banyan.bench.report import write_json
from banyan.bench.workloads import random_workload
from banyan.model_files import resolve_model_dir

STEPS = (8, 1)


def engines(quantization: str) -> dict[int, Engine]:
    model = str(resolve_model_dir(None, show_progress=False))
    return {steps: Engine(model, dtype="bfloat16", device="cpu", quantization=quantization,
                          disable_tqdm=True, kv_cache_memory="512MiB",
                          num_scheduler_steps=steps) for steps in STEPS}


def measure(quantization: str, rounds: int, batched: bool) -> dict[str, Any]:
    pair = engines(quantization)
    vocab = pair[1].core.vocab_size
    for engine in pair.values():  # warm-up: kernels, RoPE tables, the first steps' sizes
        batch1(engine, 16, 8, vocab)
    b1: dict[int, list[float]] = {s: [] for s in STEPS}
    random64: dict[int, list[float]] = {s: [] for s in STEPS}
    for _ in range(rounds):
        for steps, engine in pair.items():
            b1[steps].append(batch1(engine, 128, 128, vocab)["decode_tok_s"])
            if batched:
                engine.flush_cache()
                work = random_workload(64, 128, 128, vocab, seed=1)
                random64[steps].append(run_workload(engine, work)["output_tok_s"])
    out: dict[str, Any] = {"batch1_decode_tok_s": b1}
    out["batch1_ratio_by_round"] = [a / b for a, b in zip(b1[8], b1[1], strict=True)]
    out["batch1_ratio_median"] = statistics.median(out["batch1_ratio_by_round"])
    if batched:
        out["random64_output_tok_s"] = random64
        out["random64_ratio_by_round"] = [a / b for a, b in zip(random64[8], random64[1],
                                                                 strict=True)]
        out["random64_ratio_median"] = statistics.median(out["random64_ratio_by_round"])
    for engine in pair.values():
        engine.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="none,int8,int4")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batched", action="store_true")
    parser.add_argument("--out", default=None)
    ns = parser.parse_args()
    result: dict[str, Any] = {"command": command_line(), "machine": machine_info(),
                              "configs": {}}
    for quantization in ns.configs.split(","):
        result["configs"][quantization] = measure(quantization, ns.rounds, ns.batched)
        r = result["configs"][quantization]
        print(quantization, "batch-1", {s: [round(x, 1) for x in v]
                                        for s, v in r["batch1_decode_tok_s"].items()},
              "ratio %.3f" % r["batch1_ratio_median"],
              "random64 ratio %.3f" % r["random64_ratio_median"] if ns.batched else "",
              flush=True)
    write_json(result, ns.out, echo=False)


if __name__ == "__main__":
    main()
