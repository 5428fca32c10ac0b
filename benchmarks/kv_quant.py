"""The quantized KV cache (`--kv-cache-dtype`) side by side with the unquantized one, in one run:

1. tokens per --kv-cache-memory (bytes per token of each storage, SmolLM2-135M's shape);
2. decode attention alone: the native kernel over 64 requests x CONTEXT tokens, all 30 layers
   (a pool of SmolLM2-135M's shape filled with random K/V), every variant once per round,
   interleaved, ROUNDS rounds; fastest and median round kept;
3. perplexity of the fixed text (`banyan bench quality`'s) with each storage, float32 model
   (fp8_e4m3 / e5m2 also with one max-scaled scale a row, the rule before kv_pool's scale
   search; `fp8` is e4m3 with one unit scale for the pool, vLLM's layout).

    python benchmarks/kv_quant.py [--rounds 9] [--context 256] [--out FILE]

The CPU is named in the JSON (`machine`); a ratio holds for the CPU it was measured on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from banyan.bench.offline import machine_info
from banyan.kernels import native
from banyan.mem import kv_pool
from banyan.mem.kv_pool import kv_bytes_per_slot, kv_code_dtype, kv_row_scales
from decode_attention import HEAD_DIM, KV_HEADS, LAYERS, decode_step  # (this script's folder)

BATCH = 64
# (label, query/model dtype, --kv-cache-dtype)
VARIANTS = [
    ("float32", torch.float32, "auto"),
    ("bfloat16", torch.bfloat16, "auto"),
    ("int8 (float32 q)", torch.float32, "int8"),
    ("int8 (bf16 q)", torch.bfloat16, "int8"),
    ("fp8_e4m3 (float32 q)", torch.float32, "fp8_e4m3"),
    ("fp8_e4m3 (bf16 q)", torch.bfloat16, "fp8_e4m3"),
    ("fp8_e5m2 (float32 q)", torch.float32, "fp8_e5m2"),
    ("fp8_e5m2 (bf16 q)", torch.bfloat16, "fp8_e5m2"),
    ("fp8 (float32 q)", torch.float32, "fp8"),  # e4m3, one unit scale for the pool
    ("fp8 (bf16 q)", torch.bfloat16, "fp8"),
]


def decode_case(dtype: torch.dtype, kv_cache_dtype: str, context: int):
    """A pool of BATCH x context random tokens and a decode step over them -> a callable
    running the step's attention in every layer, and the pool."""
    # requests' slots interleaved in runs of 16, as a busy allocator hands them out
    slots = BATCH * context + 1
    order = torch.arange(1, slots).view(-1, BATCH, 16).transpose(0, 1).reshape(BATCH, context)
    return decode_step(order.tolist(), dtype, kv_cache_dtype=kv_cache_dtype)


def time_kernels(rounds: int, context: int) -> list[dict[str, object]]:
    cases = [(label, *decode_case(dtype, kv, context)) for label, dtype, kv in VARIANTS]
    times: dict[str, list[float]] = {label: [] for label, _, _ in cases}
    for _ in range(rounds):
        for label, run, _ in cases:
            run()  # warm: caches, thread pool
            t0 = time.perf_counter()
            run()
            times[label].append(time.perf_counter() - t0)
    base = min(times["bfloat16"])
    rows = []
    for label, _, pool in cases:
        best = min(times[label])
        kv_bytes = BATCH * context * pool.bytes_per_slot
        rows.append({"variant": label, "ms_best": best * 1e3,
                     "ms_median": statistics.median(times[label]) * 1e3,
                     "vs_bf16_time": best / base, "kv_bytes_read": kv_bytes,
                     "gb_per_s": kv_bytes / best / 1e9})
    return rows


def perplexities() -> list[dict[str, object]]:
    from banyan.bench.quality import REFERENCE_TEXT, banyan_perplexity
    from banyan.model_files import load_tokenizer, resolve_model_dir
    from banyan.runner.model_runner import ModelRunner

    folder = resolve_model_dir(None)
    ids = list(load_tokenizer(folder).encode(REFERENCE_TEXT))
    rows = []
    searched = kv_pool.fp8_shifts
    # fp8 also as it was before the scale search: each row's one max-scaled scale
    for kv, one_scale in (("auto", False), ("int8", False), ("fp8_e4m3", False),
                          ("fp8_e5m2", False), ("fp8", False), ("fp8_e4m3", True),
                          ("fp8_e5m2", True)):
        kv_pool.fp8_shifts = (lambda device: torch.ones(1)) if one_scale else searched
        runner = ModelRunner(folder, dtype="float32", num_slots=len(ids) + 1, max_rows=1,
                             max_context=len(ids), kv_cache_dtype=kv, show_progress=False)
        rows.append({"kv_cache_dtype": kv + (" (one scale a row)" if one_scale else ""),
                     "tokens": len(ids), "ppl": banyan_perplexity(runner, ids, 128).ppl})
    kv_pool.fp8_shifts = searched
    for row in rows:
        row["vs_auto"] = row["ppl"] / rows[0]["ppl"] - 1
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--context", type=int, default=256, help="tokens per request (multiple of 16)")
    ap.add_argument("--out", type=Path, default=None)
    ns = ap.parse_args()
    if native.load() is None:
        print("native kernels unavailable", file=sys.stderr)
        return 1
    capacity = [{"kv_cache_dtype": kv, "dtype": str(dt).removeprefix("torch."),
                 "bytes_per_token": kv_bytes_per_slot(LAYERS, KV_HEADS, HEAD_DIM, dt,
                                                      kv_code_dtype(kv), kv_row_scales(kv))}
                for dt in (torch.float32, torch.bfloat16) for kv in ("auto", "int8", "fp8")]
    report = {"command": "python " + " ".join(sys.argv), "machine": machine_info(),
              "threads": torch.get_num_threads(), "batch": BATCH, "context": ns.context,
              "capacity": capacity, "decode_attention": time_kernels(ns.rounds, ns.context),
              "perplexity": perplexities()}
    text = json.dumps(report, indent=2)
    print(text)
    if ns.out:
        ns.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
