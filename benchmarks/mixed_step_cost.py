"""What running a mixed step as two forwards costs (banyan/runner/mixed_step.py): one runner,
steps of D decodes beside one prefill chunk of C tokens, split (the default) and in one forward
(`split_mixed_steps` off), alternated step by step in one process; medians of --rounds steps.
Also a step of the D decodes alone, the cost the split adds at most (a second pass over the
weights).

    python benchmarks/mixed_step_cost.py [--model DIR_OR_GGUF] [--dtype bfloat16]
        [--decodes 1,4,16] [--chunks 128,512,2048] [--rounds 9] [--out F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from banyan.batch import ForwardBatch
from banyan.bench.offline import command_line, machine_info
from banyan.model_files import resolve_model_dir
from banyan.runner.model_runner import ModelRunner

CONTEXT = 300  # tokens each decoding request holds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--decodes", default="1,4,16")
    ap.add_argument("--chunks", default="128,512,2048")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", type=Path, default=None)
    ns = ap.parse_args()
    decodes = [int(d) for d in ns.decodes.split(",")]
    chunks = [int(c) for c in ns.chunks.split(",")]
    rows = max(decodes) + 1
    runner = ModelRunner(resolve_model_dir(ns.model, show_progress=False), dtype=ns.dtype,
                         num_slots=rows * 2560 + 1, max_rows=rows, max_context=2560,
                         show_progress=False)
    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(100, 10000, (n,), generator=gen).tolist()

    def slots(row: int, start: int, n: int) -> list[int]:
        return list(range(1 + row * 2560 + start, 1 + row * 2560 + start + n))

    with torch.inference_mode():
        for r in range(rows - 1):  # the decoding requests' contexts
            runner.forward(ForwardBatch(rows=[r], prefix_lens=[0], extend_lens=[CONTEXT],
                                        input_ids=ids(CONTEXT), out_slots=slots(r, 0, CONTEXT),
                                        sample_indices=[0]))
    results = []
    for d in decodes:
        for c in chunks:
            chunk_row = rows - 1

            def step(split: bool, with_chunk: bool = True) -> float:
                batch = ForwardBatch(
                    rows=list(range(d)) + ([chunk_row] if with_chunk else []),
                    prefix_lens=[CONTEXT] * d + ([0] if with_chunk else []),
                    extend_lens=[1] * d + ([c] if with_chunk else []),
                    input_ids=ids(d + (c if with_chunk else 0)),
                    out_slots=[s for r in range(d) for s in slots(r, CONTEXT, 1)]
                    + (slots(chunk_row, 0, c) if with_chunk else []),
                    sample_indices=list(range(d + (1 if with_chunk else 0))))
                runner.split_mixed_steps = split
                t0 = time.perf_counter()
                with torch.inference_mode():
                    runner.forward(batch)
                return time.perf_counter() - t0

            times: dict[str, list[float]] = {"split": [], "one forward": [], "decodes alone": []}
            for i in range(ns.rounds + 1):
                order = list(times) if i % 2 == 0 else list(times)[::-1]
                for name in order:
                    t = step(name == "split", name != "decodes alone")
                    if i:  # (the first round warms up)
                        times[name].append(t)
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            results.append({"decodes": d, "chunk": c, "median_ms": med,
                            "split_over_one": med["split"] / med["one forward"]})
            print(f"{d:2d} decodes + {c:4d}-token chunk: split {med['split']:7.1f} ms, one "
                  f"forward {med['one forward']:7.1f} ms ({med['split'] / med['one forward']:.3f}x)"
                  f"; the decodes alone {med['decodes alone']:.1f} ms", flush=True)
    runner.split_mixed_steps = True
    if ns.out:
        ns.out.write_text(json.dumps({"command": command_line(),
                                      "machine": machine_info(), "dtype": ns.dtype,
                                      "model": ns.model or "default", "results": results},
                                     indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
