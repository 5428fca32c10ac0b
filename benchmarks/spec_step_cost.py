"""How much a step costs as guesses are added: the forward time of one request extending T
tokens (1 = a plain decode, T = a decode checking T-1 guesses), and of B decodes, on the real
model. Where the time stops being flat is where speculation stops being free: the default of
--speculative-max-step-tokens comes from here.

    python benchmarks/spec_step_cost.py [--dtype float32] \\
        [--out benchmarks/results/spec-step-cost.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from banyan.batch import ForwardBatch
from banyan.bench.offline import machine_info
from banyan.model_files import resolve_model_dir
from banyan.runner.model_runner import ModelRunner

CONTEXT = 256


def timed(runner: ModelRunner, batch: ForwardBatch, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        runner.forward(batch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", default=None)
    ns = parser.parse_args()
    rows = 64
    runner = ModelRunner(resolve_model_dir(None), dtype=ns.dtype, num_slots=rows * 320 + 1,
                         max_rows=rows, max_context=512, show_progress=False)
    # Every row holds the same CONTEXT tokens (its own slots), as 64 requests mid-decode would.
    ids = [(7 * i) % 4000 + 100 for i in range(CONTEXT)]
    for r in range(rows):
        base = 1 + r * 320
        runner.forward(ForwardBatch(rows=[r], prefix_lens=[0], extend_lens=[CONTEXT],
                                    input_ids=ids, out_slots=list(range(base, base + CONTEXT)),
                                    sample_indices=[0]))
    one_request: dict[int, float] = {}
    for t in (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32):
        batch = ForwardBatch(rows=[0], prefix_lens=[CONTEXT], extend_lens=[t], input_ids=[5] * t,
                             out_slots=list(range(1 + CONTEXT, 1 + CONTEXT + t)),
                             sample_indices=[0], proposed=[[5] * (t - 1)])
        one_request[t] = timed(runner, batch, ns.reps)
    decodes: dict[int, float] = {}
    for b in (1, 2, 4, 8, 16, 32, 64):
        batch = ForwardBatch(rows=list(range(b)), prefix_lens=[CONTEXT] * b, extend_lens=[1] * b,
                             input_ids=[5] * b,
                             out_slots=[1 + r * 320 + CONTEXT for r in range(b)],
                             sample_indices=list(range(b)))
        decodes[b] = timed(runner, batch, ns.reps)
    out = {
        "command": "python benchmarks/spec_step_cost.py --dtype " + ns.dtype,
        "machine": machine_info(), "dtype": ns.dtype, "context": CONTEXT,
        "threads": torch.get_num_threads(),
        "one_request_extend_ms": {t: round(v * 1e3, 2) for t, v in one_request.items()},
        "one_request_vs_decode": {t: round(v / one_request[1], 3) for t, v in one_request.items()},
        "batch_decode_ms": {b: round(v * 1e3, 2) for b, v in decodes.items()},
        "batch_decode_vs_one": {b: round(v / decodes[1], 3) for b, v in decodes.items()},
    }
    print(json.dumps(out, indent=2))
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
