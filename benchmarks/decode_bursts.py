"""Bursts of decode steps (`--num-scheduler-steps`) against one step at a time, side by side.

For each weight format one engine (the default model's weights) switches between bursts of up
to 8 steps and 1 request by request (its scheduler's `decode_steps`), in ABBA order: two
engines in one process hold their weights at different addresses, which measured a few percent
apart on their own. Each round: one batch-1 128/128 request each way (decode tok/s) and, with
--batched, random 64 x 128/128 each way (output tok/s; a step of 64 decodes takes ~30 ms, past
the burst budget, so it runs alone: the ratio should be ~1). Ratios per round, bursts over
single steps, then their median.

    python benchmarks/decode_bursts.py [--configs none,int8,int4] [--rounds 12] [--batched]
                                       [--dtype bfloat16] [--out FILE]
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


def ratios(runs: dict[int, list[float]]) -> dict[str, Any]:
    by_round = [a / b for a, b in zip(runs[8], runs[1], strict=True)]
    return {"runs": runs, "ratio_by_round": by_round, "ratio_median": statistics.median(by_round)}


def measure(quantization: str, rounds: int, batched: bool, dtype: str) -> dict[str, Any]:
    engine = Engine(str(resolve_model_dir(None, show_progress=False)), dtype=dtype,
                    device="cpu", quantization=quantization, disable_tqdm=True,
                    kv_cache_memory="512MiB")
    config = engine.core.scheduler.config
    assert config.decode_steps == 8, "bursts are off for this engine"
    vocab = engine.core.vocab_size
    batch1(engine, 16, 8, vocab)  # warm-up: kernels, RoPE tables, the lane's step time
    b1: dict[int, list[float]] = {s: [] for s in STEPS}
    random64: dict[int, list[float]] = {s: [] for s in STEPS}
    for r in range(rounds):
        for steps in STEPS if r % 2 == 0 else STEPS[::-1]:
            config.decode_steps = steps
            b1[steps].append(batch1(engine, 128, 128, vocab)["decode_tok_s"])
            if batched:
                engine.flush_cache()
                work = random_workload(64, 128, 128, vocab, seed=1)
                random64[steps].append(run_workload(engine, work)["output_tok_s"])
    engine.close()
    out = {"batch1_decode_tok_s": ratios(b1)}
    if batched:
        out["random64_output_tok_s"] = ratios(random64)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="none,int8,int4")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--batched", action="store_true")
    parser.add_argument("--dtype", default="bfloat16",
                        help="the activations' dtype (float32 where the CPU has no bf16 units)")
    parser.add_argument("--out", default=None)
    ns = parser.parse_args()
    result: dict[str, Any] = {"command": command_line(), "machine": machine_info(),
                              "configs": {}}
    for quantization in ns.configs.split(","):
        result["configs"][quantization] = measure(quantization, ns.rounds, ns.batched, ns.dtype)
        r = result["configs"][quantization]
        print(quantization, {name: (round(part["ratio_median"], 3),
                                    {k: [round(x, 1) for x in v] for k, v in part["runs"].items()})
                             for name, part in r.items()}, flush=True)
    write_json(result, ns.out, echo=False)


if __name__ == "__main__":
    main()
