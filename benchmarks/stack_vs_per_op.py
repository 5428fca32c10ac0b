"""What the native layer stack is worth: the same engine with the stack and with every step on
the per-op path (`runner.stack = None`: each layer's ~40 torch and kernel calls from Python),
batch-1 128/128 and random 64 x 128/128, side by side in one run (engines built once, then run
in turn, round after round), on the dense bf16 folder of the default model and on its GGUF
blocks.

The stack takes steps of up to 256 tokens (batch-1 and batched decodes, short chunks) where
every projection has a native kernel it can call. On the first AMX Xeon measured (2026-12-06,
results/stack-vs-per-op-f6m207-amx-1206.json) a dense bf16 model's steps of more than 16 tokens
still went to oneDNN's GEMM on AMX tiles, its head too, and a third engine ran
`--linear-kernel native` (the pairs GEMM for every step of up to 256 tokens, on AMX tiles where
they check out): batch-1 1.51x, random 64 even, so that is now `auto` there too and the two
engines left are the same everywhere.

    python benchmarks/stack_vs_per_op.py [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from banyan import Engine
from banyan.bench.offline import (batch1, command_line, machine_info, run_workload,
                                   write_result)
from banyan.bench.workloads import random_workload

MODELS = {"dense bf16": "none", "default (GGUF Q4_1 blocks)": "auto"}  # -> --quantization
DECODE_STEPS = 127  # random 64 x 128/128: the steps after the prefill's first token


def engines(quantization: str) -> dict[str, Engine]:
    out = {}
    for stack in (True, False):
        engine = _engine(quantization)
        runner = engine.core.scheduler.runner.model_runner
        if runner.stack is None:  # (nothing to compare)
            for e in (engine, *out.values()):
                e.close()
            return {}
        if not stack:
            runner.stack = None
        out["stack" if stack else "per-op"] = engine
    return out


def _engine(quantization: str) -> Engine:
    engine = Engine(None, dtype="bfloat16", quantization=quantization, kv_cache_memory="512MiB",
                    max_running_requests=64, disable_tqdm=True)
    engine.core.populate_kv()  # (no engine faulting pages in beside another's run)
    return engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    result: dict[str, Any] = {"command": command_line(), "machine": machine_info(),
                              "models": {}}
    for model, quantization in MODELS.items():
        built = engines(quantization)
        if not built:
            result["models"][model] = "no layer stack on this machine"
            continue
        vocab = built["stack"].core.vocab_size
        work = random_workload(64, 128, 128, vocab, seed=1)
        warm = random_workload(64, 128, 128, vocab, seed=2)
        for engine in built.values():  # warm-up (the first batched steps fault pages in)
            batch1(engine, 32, 8, vocab)
            run_workload(engine, warm, use_tqdm=False)
        runs: dict[str, dict[str, list[float]]] = {
            k: {"batch1_tok_s": [], "random_s": []} for k in built}
        for r in range(ns.rounds):
            for name, engine in built.items():  # each run from an empty prefix cache
                engine.core.flush_cache()
                runs[name]["batch1_tok_s"].append(
                    batch1(engine, 128, 128, vocab)["decode_tok_s"])
                engine.core.flush_cache()
                out = run_workload(engine, work, use_tqdm=False)
                runs[name]["random_s"].append(out["elapsed_s"])
                print(f"{model} round {r} {name}: batch-1 {runs[name]['batch1_tok_s'][-1]:.1f} "
                      f"tok/s, random 64 {runs[name]['random_s'][-1]:.2f} s", flush=True)
        for engine in built.values():
            engine.close()
        med = {k: {w: statistics.median(v) for w, v in d.items()} for k, d in runs.items()}
        result["models"][model] = {
            "runs": runs, "median": med,
            "vs_per_op": {k: {
                "batch1": med[k]["batch1_tok_s"] / med["per-op"]["batch1_tok_s"],
                "random64": med["per-op"]["random_s"] / med[k]["random_s"]} for k in med},
            # the random run's whole time difference put on its decode steps (its two long
            # prefill steps take the per-op path in both engines)
            "per_op_ms_a_batched_step": 1e3 * (med["per-op"]["random_s"]
                                                - med["stack"]["random_s"]) / DECODE_STEPS}
    write_result(result, ns.out)


if __name__ == "__main__":
    main()
