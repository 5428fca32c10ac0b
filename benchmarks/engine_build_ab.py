"""Two builds of the native kernels in one engine, request by request: batch-1 128/128 decode
speed with the layer stack's entry point taken from each library in turn (every kernel a step
calls is that library's own), ABBA order, per weight format. Where layer_stack_ab.py times one
step through the runner, this times what a user sees: the engine's steps, bursts included.
--workload random64 (or random16, random8): random 64 (16, 8) x 128/128 output tok/s instead
(new prompts every run; their long prefill steps take the per-op path, the engine's own build in
both; random 8 and 16 decode in steps of the short kernels' sizes, random 64 in the GEMM's);
grounded: `banyan bench`'s grounded workload at batch 1 with ngram speculation (its checks of
up to 16 tokens in the stack), output tok/s, the prefix cache flushed before each run.

    python benchmarks/engine_build_ab.py A.so B.so [--quantization int4,int8,none]
        [--workload batch1|random64|random16|random8] [--rounds 16] [--out F] [--input-len N]
"""

from __future__ import annotations

import json
import statistics
import sys
from argparse import ArgumentParser

from banyan import Engine
from banyan.bench.grounded import grounded_workload
from banyan.bench.offline import batch1, machine_info, run_workload
from banyan.bench.workloads import random_workload
from banyan.model_files import load_tokenizer, resolve_model_dir
from two_builds import parse_args, stack_entries  # (this script's folder)


def main() -> int:
    def more(ap: ArgumentParser) -> None:
        ap.add_argument("--quantization", default="int4,int8,none")
        ap.add_argument("--workload", default="batch1",
                        choices=["batch1", "random64", "random16", "random8", "grounded"])
        ap.add_argument("--input-len", type=int, default=128,
                        help="batch1's prompt (over 256 tokens its decodes read keys in parts)")

    ns = parse_args(__doc__, "128", 16, more)
    cases = []
    for q in ns.quantization.split(","):
        folder = resolve_model_dir(None)
        spec = {"speculative_algorithm": "ngram", "max_running_requests": 1} \
            if ns.workload == "grounded" else {}
        engine = Engine(str(folder), dtype="bfloat16", device="cpu", quantization=q,
                        disable_tqdm=True, kv_cache_memory="512MiB", **spec)
        vocab = engine.core.vocab_size
        stack = engine.core.scheduler.runner.model_runner.stack
        if stack is None:
            raise SystemExit(f"{q}: no native layer stack here")
        entry = stack._call
        calls = stack_entries(stack, ns.a, ns.b)
        batch1(engine, 16, 8, vocab)  # warm
        grounded = grounded_workload(load_tokenizer(folder), 5, 128) \
            if ns.workload == "grounded" else None
        requests = int(ns.workload.removeprefix("random")) if "random" in ns.workload else 0
        if requests:  # (the pool's pages and each step size's first buffers)
            run_workload(engine, random_workload(requests, 128, 128, vocab, seed=1))
        if grounded is not None:
            run_workload(engine, grounded)

        def speed(engine: Engine, run: int) -> float:
            if ns.workload == "batch1":
                return batch1(engine, ns.input_len, 128, vocab)["decode_tok_s"]
            if grounded is not None:
                engine.flush_cache()
                return run_workload(engine, grounded)["output_tok_s"]
            work = random_workload(requests, 128, 128, vocab, seed=2 + run)  # (no cached prefix)
            return run_workload(engine, work)["output_tok_s"]

        tok_s: dict[str, list[float]] = {"a": [], "b": []}
        for r in range(ns.rounds):
            for i, name in enumerate(("a", "b") if r % 2 == 0 else ("b", "a")):
                stack._call = calls[name]
                tok_s[name].append(speed(engine, 2 * r + i))
        stack._call = entry
        ratios = [b / a for a, b in zip(tok_s["a"], tok_s["b"])]
        case = {"quantization": q, "workload": ns.workload, "input_len": ns.input_len,
                "a_tok_s": statistics.median(tok_s["a"]),
                "b_tok_s": statistics.median(tok_s["b"]),
                "b_over_a_tok_s": statistics.median(ratios),
                "ratios_by_round": [round(x, 3) for x in ratios]}
        cases.append(case)
        print(f"{q:5s} a {case['a_tok_s']:6.1f} b {case['b_tok_s']:6.1f} tok/s  "
              f"b/a {case['b_over_a_tok_s']:.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f})",
              flush=True)
        del engine
    if ns.out:
        ns.out.write_text(json.dumps({"command": ns.command, "machine": machine_info(),
                                      "rounds": ns.rounds, "a": ns.a.name, "b": ns.b.name,
                                      "cases": cases}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
