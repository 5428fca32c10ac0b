"""The low-precision flags on a GPU (benchmarks/gpu/check.sh; #16 item 4): a random-weight
1.2B Llama-shaped model (bench.py's) in bf16 with `--quantization none|int8|int4` and
`--kv-cache-dtype auto|fp8_e4m3|fp8` (fp8: one unit scale for the pool), each engine in turn:
batch-1 128/128 decode tok/s and random 64 x 128/128 output tok/s, and each batch-1 request's
greedy tokens against bf16's (how many of the first 32 agree: quantized weights may part from
bf16 at near-ties, never from the start).

    python benchmarks/gpu/low_precision.py --out-dir DIR [--quick]
    (a smoke run on CPU: --device cpu --quick, the small shape)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from banyan import Engine, SamplingParams
from banyan.bench.offline import batch1, command_line, run_workload
from banyan.bench.workloads import random_workload
from banyan.demo import build_random_model

sys.path.insert(0, str(Path(__file__).parent))
from bench import SHAPES, log  # noqa: E402

CONFIGS = [("none", "auto"), ("int8", "auto"), ("int4", "auto"), ("none", "fp8_e4m3"),
           ("int4", "fp8_e4m3"), ("none", "fp8")]
PROMPT = [5 + (7 * i) % 900 for i in range(128)]


def measure(folder: Path, device: str, quantization: str, kv: str, quick: bool) -> dict[str, Any]:
    with Engine(str(folder), dtype="bfloat16", device=device, disable_tqdm=True,
                kv_cache_memory="4GiB", max_running_requests=64, quantization=quantization,
                kv_cache_dtype=kv) as engine:
        vocab = engine.core.vocab_size
        batch1(engine, 32, 8, vocab)  # warm-up: Triton compiles each kernel variant once
        params = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
        tokens = engine.generate(input_ids=[PROMPT], sampling_params=params)[0].output_ids
        one = batch1(engine, 128, 16 if quick else 128, vocab)
        n = 8 if quick else 64
        rnd = run_workload(engine, random_workload(n, 128, 16 if quick else 128, vocab, seed=1),
                           use_tqdm=False)
        return {"weight_bytes": engine.core.weight_bytes, "tokens": tokens,
                "batch1_decode_tok_s": one["decode_tok_s"],
                "random_output_tok_s": rnd["output_tok_s"], "random_requests": n}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", default="llama-1.2b-shape", choices=sorted(SHAPES))
    ns = ap.parse_args(argv)
    result: dict[str, Any] = {"command": command_line(), "date": time.strftime("%Y-%m-%d %H:%M"),
                              "device": (torch.cuda.get_device_name(0)
                                         if ns.device.startswith("cuda") else ns.device),
                              "model": ns.model, "runs": {}}
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_random_model(Path(tmp) / ns.model, "llama", tokenizer_vocab=32000,
                                    tokenizer_corpus_bytes=2_000_000, dtype="bfloat16", seed=0,
                                    vocab_size=32000, max_position_embeddings=2048,
                                    **SHAPES[ns.model])
        for quantization, kv in CONFIGS:
            name = f"{quantization}/{kv}"
            log(f"measuring {name}")
            try:
                result["runs"][name] = measure(folder, ns.device, quantization, kv, ns.quick)
            except Exception as e:  # noqa: BLE001 - reported, the other configurations still run
                result["runs"][name] = {"error": f"{type(e).__name__}: {e}"}
                failed = True
            log(json.dumps({k: v for k, v in result["runs"][name].items() if k != "tokens"}))
    base = result["runs"].get("none/auto", {})
    lines = [f"# Low precision on {result['device']}, {result['date']} ({ns.model}, bf16)", "",
             "| weights / KV | batch-1 decode tok/s | vs bf16 | random 64 tok/s | vs bf16 | "
             "greedy tokens equal to bf16's (of 32) |", "|---|---:|---:|---:|---:|---:|"]
    for name, run in result["runs"].items():
        if "error" in run:
            lines.append(f"| {name} | {run['error'][:70]} | | | | |")
            continue
        agree = 0
        for a, b in zip(run["tokens"], base.get("tokens", [])):
            if a != b:
                break
            agree += 1
        b1 = run["batch1_decode_tok_s"] / base.get("batch1_decode_tok_s", float("nan"))
        rnd = run["random_output_tok_s"] / base.get("random_output_tok_s", float("nan"))
        lines.append(f"| {name} | {run['batch1_decode_tok_s']:.1f} | {b1:.2f}x | "
                     f"{run['random_output_tok_s']:.1f} | {rnd:.2f}x | {agree} |")
    out = Path(ns.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-low-precision.json").write_text(json.dumps(result, indent=2))
    (out / "gpu-low-precision.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
