"""The GPU check's benchmark (run by benchmarks/gpu/check.sh on a CUDA machine).

Two random-weight models built on the machine (nothing downloaded): SmolLM2-135M's shape, and a
1.2B Llama-3.2-1B-like shape (hidden 2048, 16 layers, GQA 32/8, MLP 8192) that keeps an H200
busy. Per model, in bfloat16 on cuda:0: random 64 x 128/128 (output tok/s, the step busy
fraction) and batch-1 128/128 (decode tok/s, and the weights read per second as a fraction of
the HBM bandwidth: 4.8 TB/s for an H200, or --hbm-tbs). Prints progress; writes one JSON and
one markdown summary.

    python benchmarks/gpu/bench.py --out-dir DIR [--hbm-tbs 4.8] [--quick]
    (a smoke run on CPU: --device cpu --quick --models smollm2-135m-shape)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from banyan import Engine
from banyan.bench.offline import batch1, command_line, run_workload
from banyan.bench.workloads import random_workload
from banyan.demo import build_random_model

sys.path.insert(0, str(Path(__file__).parent))
from batch1_variants import decode_ms, diagnose, small_engine  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m-shape": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                               num_key_value_heads=3, intermediate_size=1536,
                               tie_word_embeddings=True, rope_theta=100000.0),
    "llama-1.2b-shape": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                             num_key_value_heads=8, intermediate_size=8192,
                             tie_word_embeddings=True, rope_theta=500000.0),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def measure(folder: Path, device: str, hbm_tbs: float, quick: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    with Engine(str(folder), dtype="bfloat16", device=device, disable_tqdm=True,
                kv_cache_memory="8GiB", max_running_requests=64) as engine:
        start_s = time.perf_counter() - t0  # weights, KV cache, graph capture
        vocab = engine.core.vocab_size
        graphs = engine.core.scheduler.runner.model_runner.graphs
        batch1(engine, 32, 8, vocab)  # warm-up: kernels compiled
        n = 16 if quick else 64
        # once to warm up (Triton compiles each new kernel variant on first use), once timed
        for _ in range(2):
            random = run_workload(engine, random_workload(n, 128, 128, vocab, seed=1),
                                  use_tqdm=False)
        one = batch1(engine, 128, 16 if quick else 128, vocab)
        weight_bytes = engine.core.weight_bytes
    read_tbs = weight_bytes * one["decode_tok_s"] / 1e12
    return {"start_s": start_s, "graph_buckets": None if graphs is None else graphs.captured,
            "random": {"requests": n, "output_tok_s": random["output_tok_s"],
                       "step_split": random["step_split"]},
            "batch1": {"decode_tok_s": one["decode_tok_s"], "ttft_s": one["ttft_s"],
                       "weight_bytes": weight_bytes, "weights_read_tbs": read_tbs,
                       "fraction_of_hbm_bound": read_tbs / hbm_tbs}}


def batch1_eager(folder: Path, device: str, quick: bool) -> float:
    """Batch-1 decode tok/s with --disable-cuda-graph: what the graphs are worth."""
    with small_engine(folder, device, disable_cuda_graph=True) as engine:
        return 1e3 / decode_ms(engine, 16 if quick else 128)


def copy_tbs(device: str) -> float | None:
    """Device-to-device copy bandwidth (bytes read + written), TB/s: the measured HBM bound."""
    if not device.startswith("cuda"):
        return None
    src = torch.randn(2**30 // 4, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 4 * 20 / (start.elapsed_time(end) / 1e3) / 1e12


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--hbm-tbs", type=float, default=4.8)
    ap.add_argument("--quick", action="store_true", help="16 requests instead of 64")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--diagnose", action="store_true",
                    help="batch-1 variants and a profile per model (batch1_variants.py)")
    ap.add_argument("--models", default=",".join(SHAPES), help="comma-separated: " +
                    ", ".join(SHAPES))
    ns = ap.parse_args(argv)
    if ns.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    out = Path(ns.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"command": command_line(),
                              "date": time.strftime("%Y-%m-%d %H:%M"),
                              "device": (torch.cuda.get_device_name(0)
                                         if ns.device.startswith("cuda") else ns.device),
                              "torch": torch.__version__, "models": {}}
    result["copy_tbs"] = copy_tbs(ns.device)
    log(f"device copy bandwidth {result['copy_tbs']} TB/s")
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = None
        for name in ns.models.split(","):
            shape = SHAPES[name]
            log(f"building {name}")
            folder = build_random_model(Path(tmp) / name, "llama", tokenizer_dir=tokenizer,
                                        tokenizer_vocab=32000, tokenizer_corpus_bytes=2_000_000,
                                        dtype="bfloat16", seed=0, vocab_size=32000,
                                        max_position_embeddings=2048, **shape)
            tokenizer = folder
            log(f"measuring {name}")
            try:  # one model's failure is reported, and the other still measured
                m = measure(folder, ns.device, ns.hbm_tbs, ns.quick)
                log(json.dumps(m["batch1"]) + f" start {m['start_s']:.1f} s")
                m["batch1"]["decode_tok_s_without_graphs"] = batch1_eager(folder, ns.device,
                                                                          ns.quick)
                log(f"without graphs: {m['batch1']['decode_tok_s_without_graphs']:.1f} tok/s")
                if ns.diagnose:
                    m["batch1_variants"] = diagnose(folder, ns.device, out / f"profile-{name}.txt",
                                                    ns.quick)
                    log(json.dumps(m["batch1_variants"]))
            except Exception as e:  # noqa: BLE001 - recorded in the result, exit status 1
                traceback.print_exc()
                m = {"error": f"{type(e).__name__}: {e}"}
                failed = True
            result["models"][name] = m
    for m in result["models"].values():
        if "batch1" in m and result["copy_tbs"]:
            m["batch1"]["fraction_of_copy_bound"] = \
                m["batch1"]["weights_read_tbs"] / result["copy_tbs"]
    (out / "gpu-check.json").write_text(json.dumps(result, indent=2))
    lines = [f"# GPU check, {result['date']}, {result['device']}, torch {result['torch']}", "",
             "| model | random output tok/s | busy | batch-1 decode tok/s | of HBM bound |",
             "|---|---:|---:|---:|---:|"]
    for name, m in result["models"].items():
        if "error" in m:
            lines.append(f"| {name} | {m['error'][:60]} | | | |")
            continue
        busy = m["random"]["step_split"].get("busy_fraction", float("nan"))
        lines.append(f"| {name} | {m['random']['output_tok_s']:.1f} | {busy:.2f} | "
                     f"{m['batch1']['decode_tok_s']:.1f} | "
                     f"{m['batch1']['fraction_of_hbm_bound']:.3f} |")
    (out / "gpu-check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
