"""Two builds of the native kernels through the whole bf16 layer stack, step by step in one
process: the default model (dense bf16, Banyan's runner and pool), its stack's entry point
taken from each library in turn (the kernels it calls are that library's own), so a drift of
the machine's speed between runs, which on these VMs moves a step by 20-40%, hits both alike.
Each step size T: one request checking T - 1 guesses over a 300-token context (T <= 16; T = 1
is a plain decode), or T decodes of 300-token contexts (T > 16; --context: another length). The
logits of both builds are compared first.

Build the other checkout's kernels (any Banyan call that loads them writes the library into
~/.cache/banyan/kernels, named by a hash of the sources), then:

    python benchmarks/layer_stack_ab.py A.so B.so [--tokens 1,8,13,64] [--rounds 30] [--out F] \
        [--model PATH] [--gguf-blocks] [--dtype float32]

--model: another checkpoint; --gguf-blocks: the linears of the model's GGUF file (the default
model's without --model) computed from its blocks; --dtype: the activations' (bfloat16 by
default; float32 where the CPU has no bf16 units);
--ops: each build's median ms a step by kind of op as well (the stack's own clocks, ~1% of a
step), where a change moves time from one op to another.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from banyan.batch import ForwardBatch
from banyan.bench.offline import machine_info
from banyan.model_files import gguf_source, resolve_model_dir
from banyan.runner.model_runner import ModelRunner
from two_builds import parse_args, stack_entries  # (this script's folder)

GAP = 100  # slots a row may use past its context


def stride(context: int) -> int:
    return context + GAP


def step(tokens: int, context: int) -> ForwardBatch:
    if tokens <= 16:
        batch = ForwardBatch(rows=[0], prefix_lens=[context], extend_lens=[tokens],
                             input_ids=[5] * tokens,
                             out_slots=list(range(1 + context, 1 + context + tokens)),
                             sample_indices=[0])
        if tokens > 1:
            batch.proposed = [[5] * (tokens - 1)]
        return batch
    return ForwardBatch(rows=list(range(tokens)), prefix_lens=[context] * tokens,
                        extend_lens=[1] * tokens, input_ids=[5] * tokens,
                        out_slots=[1 + r * stride(context) + context for r in range(tokens)],
                        sample_indices=list(range(tokens)))


def main() -> int:
    def more(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--model", default=None)
        ap.add_argument("--gguf-blocks", action="store_true")
        ap.add_argument("--dtype", default="bfloat16")
        ap.add_argument("--context", type=int, default=300)
        ap.add_argument("--ops", action="store_true")

    ns = parse_args(__doc__, "1,8,13,64", 30, more)
    sizes = ns.tokens
    rows = max(max(sizes), 1)
    gguf = gguf_source(ns.model) if ns.gguf_blocks else None
    if ns.gguf_blocks and gguf is None:
        raise SystemExit(f"no GGUF file for --model {ns.model}")
    runner = ModelRunner(resolve_model_dir(ns.model), dtype=ns.dtype, max_rows=rows,
                         num_slots=rows * stride(ns.context) + 1, show_progress=False,
                         quantization="gguf" if gguf else "none", gguf_file=gguf)
    stack = runner.stack
    if stack is None:
        raise SystemExit("no native layer stack for this model here")
    entry = stack._call
    calls = stack_entries(stack, ns.a, ns.b)
    ids = [(7 * i) % 4000 + 100 for i in range(ns.context)]
    for r in range(rows):  # every row's context in the pool
        first = 1 + r * stride(ns.context)
        runner.forward(ForwardBatch(rows=[r], prefix_lens=[0], extend_lens=[ns.context],
                                    input_ids=ids,
                                    out_slots=list(range(first, first + ns.context)),
                                    sample_indices=[0]))
    results = []
    for tokens in sizes:
        logits = {}
        for name, fn in calls.items():
            stack._call = fn
            logits[name] = runner.forward(step(tokens, ns.context)).clone()
        seconds: dict[str, list[float]] = {name: [] for name in calls}
        ops: dict[str, list[dict[str, float]]] = {name: [] for name in calls}
        for r in range(ns.rounds):
            for name in ("a", "b") if r % 2 else ("b", "a"):
                stack._call = calls[name]
                if ns.ops:
                    stack.time_ops()  # (from zero)
                t0 = time.perf_counter()
                runner.forward(step(tokens, ns.context))
                seconds[name].append(time.perf_counter() - t0)
                if ns.ops:
                    ops[name].append(stack.op_seconds())
        if ns.ops:
            stack.time_ops(False)
        a, b = (statistics.median(seconds[n]) for n in ("a", "b"))
        same = torch.equal(logits["a"], logits["b"])
        case = {"tokens": tokens, "a_median_ms": a * 1e3, "b_median_ms": b * 1e3,
                "b_over_a": b / a, "same_logits": same}
        print(f"T={tokens:3d}: a {a * 1e3:.2f} ms b {b * 1e3:.2f} ms  b/a {b / a:.3f}  "
              f"same logits {same}", flush=True)
        for name in ops if ns.ops else ():
            case[f"{name}_op_ms"] = split = {
                op: round(statistics.median(o[op] for o in ops[name]) * 1e3, 3)
                for op in ops[name][0]}
            print(f"       {name} ms by op: {split}", flush=True)
        results.append(case)
    stack._call = entry
    if ns.out:
        ns.out.write_text(json.dumps({"command": ns.command,
                                      "machine": machine_info(), "context": ns.context,
                                      "model": str(ns.model or "the default model"),
                                      "gguf_blocks": ns.gguf_blocks,
                                      "dtype": ns.dtype,
                                      "rounds": ns.rounds, "a": ns.a.name, "b": ns.b.name,
                                      "cases": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
