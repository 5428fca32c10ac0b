"""The quantized KV cache end to end: batch-1 128/128 and random 64 x 128/128 through the
engine with each `--kv-cache-dtype`, side by side in one run (engines built once, then run in
turn, round after round), on the default model (its GGUF blocks) and on the dense bf16 one.

Each quantized pool also runs once with the native layer stack switched off (`runner.stack =
None`): the per-op path every step, which is how a bf16 model over a quantized pool ran before
the stack stored and attended codes itself.

    python benchmarks/kv_quant_engine.py [--rounds 3] [--out FILE]

The CPU is named in the JSON (`machine`); a ratio holds for the CPU it was measured on.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from banyan import Engine
from banyan.bench.offline import (batch1, command_line, machine_info, run_workload,
                                   write_result)
from banyan.bench.workloads import random_workload

KVS = ["auto", "int8", "fp8_e4m3", "fp8_e5m2", "fp8"]
MODELS = {"default (GGUF Q4_1 blocks)": "auto", "dense bf16": "none"}  # -> --quantization


def engines(quantization: str) -> dict[str, Engine]:
    """An engine per KV storage, and one more per quantized storage with its stack off (where
    the model has a stack at all: a name saying so where it has none)."""
    out = {}
    for kv in KVS:
        for stack in (True, False) if kv != "auto" else (True,):
            engine = Engine(None, dtype="bfloat16", quantization=quantization, kv_cache_dtype=kv,
                            kv_cache_memory="512MiB", max_running_requests=64,
                            disable_tqdm=True)
            engine.core.populate_kv()  # (no engine faulting pages in beside another's run)
            runner = engine.core.scheduler.runner.model_runner
            if runner.stack is None and not stack:
                engine.close()  # the same as the engine before it
                continue
            name = kv if runner.stack is not None else f"{kv} (no stack here)"
            if not stack:
                runner.stack, name = None, f"{kv}, no stack"
            out[name] = engine
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--random", type=int, default=64, help="requests of the random workload")
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    result: dict[str, Any] = {"command": command_line(), "machine": machine_info(),
                              "models": {}}
    for model, quantization in MODELS.items():
        built = engines(quantization)
        vocab = next(iter(built.values())).core.vocab_size
        work = random_workload(ns.random, 128, 128, vocab, seed=1)
        runs: dict[str, dict[str, list[float]]] = {k: {"batch1": [], "random": []} for k in built}
        warm = random_workload(ns.random, 128, 128, vocab, seed=2)
        for engine in built.values():  # warm-up (the first batched steps fault pages in)
            batch1(engine, 32, 8, vocab)
            run_workload(engine, warm, use_tqdm=False)
        for r in range(ns.rounds):
            for name, engine in built.items():  # each run from an empty prefix cache
                engine.core.flush_cache()
                runs[name]["batch1"].append(batch1(engine, 128, 128, vocab)["decode_tok_s"])
                engine.core.flush_cache()
                runs[name]["random"].append(
                    run_workload(engine, work, use_tqdm=False)["output_tok_s"])
                print(f"{model} round {r} {name}: batch-1 {runs[name]['batch1'][-1]:.1f}, "
                      f"random {runs[name]['random'][-1]:.1f} tok/s", flush=True)
        for engine in built.values():
            engine.close()
        med = {k: {w: statistics.median(v) for w, v in d.items()} for k, d in runs.items()}
        base = med[next(iter(med))]  # the bf16 pool's (KVS[0])
        result["models"][model] = {
            "runs": runs, "median": med,
            "vs_bf16_pool": {k: {w: med[k][w] / base[w] for w in ("batch1", "random")}
                             for k in med}}
    write_result(result, ns.out)


if __name__ == "__main__":
    main()
