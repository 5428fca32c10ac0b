"""Hugging Face transformers as a peer, on the same workloads as `banyan bench offline`.

Two modes:
- generate: static batching with `model.generate` — requests grouped by output length, sorted by
  prompt length (least padding: transformers at its best), left-padded batches of --batch-size,
  greedy, min_new_tokens = max_new_tokens (ignore_eos).
- cb: the continuous-batching API of transformers 5.x (the manager behind `generate_batch`),
  greedy with EOS disabled, per-request max_new_tokens, its KV cache sized explicitly (--kv-gib,
  4 GiB like the others: without psutil transformers cannot size it on CPU and runs many times
  slower), a fresh manager per run built before the clock starts.

Standalone (the project's venv has transformers):

    .venv/bin/python benchmarks/peers/hf_transformers.py run --model DIR --mode generate \\
        --workload random --num-requests 64 --input-len 128 --output-len 128 [--out r.json]

As a worker of run_side_by_side.py: `hf_transformers.py worker --model DIR --mode cb`.
Only independent workloads (random, shared-prefix): neither mode can chain requests.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from worker_protocol import start, warmup_prompts


def load_model(model_dir: str, dtype: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    return model.eval()


def static_generate(model: Any, prompts: list[list[int]], output_lens: list[int],
                    batch_size: int, pad_id: int) -> int:
    import torch

    order = sorted(range(len(prompts)), key=lambda i: (output_lens[i], len(prompts[i])))
    produced = 0
    with torch.inference_mode():
        for out_len, group in itertools.groupby(order, key=lambda i: output_lens[i]):
            idx = list(group)
            for start_ in range(0, len(idx), batch_size):
                batch = [prompts[i] for i in idx[start_:start_ + batch_size]]
                width = max(len(p) for p in batch)
                ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
                mask = torch.zeros((len(batch), width), dtype=torch.long)
                for row, p in enumerate(batch):
                    ids[row, width - len(p):] = torch.tensor(p)
                    mask[row, width - len(p):] = 1
                out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                     max_new_tokens=out_len, min_new_tokens=out_len,
                                     pad_token_id=pad_id)
                produced += (out.shape[1] - width) * len(batch)
    return produced


def continuous_batching(model: Any, prompts: list[list[int]], output_lens: list[int],
                        kv_gib: float) -> tuple[int, float]:
    """(tokens produced, seconds): a fresh manager per run (no cache carried over), built and
    started before the clock starts, stopped after it stops. The KV cache is sized explicitly
    (kv_gib): without psutil transformers cannot size it on CPU and crawls."""
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    cfg = model.config
    page = 256
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    block_bytes = (cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim
                   * model.dtype.itemsize * page)
    cb = ContinuousBatchingConfig(page_size=page,
                                  num_blocks=max(16, int(kv_gib * 2**30 // block_bytes)),
                                  max_batch_tokens=4096)
    gen = GenerationConfig(max_new_tokens=max(output_lens), do_sample=False, eos_token_id=-1,
                           pad_token_id=0)
    with model.continuous_batching_context_manager(generation_config=gen,
                                                   continuous_batching_config=cb, warmup=False,
                                                   block=True, timeout=30) as manager:
        t0 = time.perf_counter()
        ids = {manager.add_request(p, max_new_tokens=o) for p, o in zip(prompts, output_lens)}
        produced = 0
        while ids:
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("the continuous-batching loop stopped")
                continue
            if result.is_finished() and result.request_id in ids:
                if result.error:
                    raise RuntimeError(f"generate_batch request failed: {result.error}")
                ids.discard(result.request_id)
                produced += len(result.generated_tokens)
        elapsed = time.perf_counter() - t0
    return produced, elapsed


def make_runner(ns: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    import torch
    import transformers

    model = load_model(ns.model, ns.dtype)
    pad_id = model.config.pad_token_id or 0

    def run(prompts: list[list[int]], output_lens: list[int]) -> dict[str, Any]:
        if ns.mode == "cb":
            n, elapsed = continuous_batching(model, prompts, output_lens, ns.kv_gib)
            return {"elapsed_s": elapsed, "output_tokens": n}
        t0 = time.perf_counter()
        n = static_generate(model, prompts, output_lens, ns.batch_size, pad_id)
        return {"elapsed_s": time.perf_counter() - t0, "output_tokens": n}

    run(warmup_prompts(model.config.vocab_size), [4] * 4)
    ready = {"engine": f"hf-{ns.mode}", "transformers": transformers.__version__,
             "torch_threads": torch.get_num_threads(), "args": vars(ns)}
    return ready, run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("worker", "run"):
        p = sub.add_parser(name)
        p.add_argument("--model", required=True)
        p.add_argument("--mode", choices=["generate", "cb"], default="generate")
        p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
        p.add_argument("--batch-size", type=int, default=64, help="generate: sequences per batch")
        p.add_argument("--kv-gib", type=float, default=4.0, help="cb: KV cache size (GiB)")
        if name == "run":
            from banyan.bench.workload_args import add_workload_args

            add_workload_args(p, ("--bench-seed",))
            p.add_argument("--out", default=None)
    ns = parser.parse_args()
    if ns.cmd == "worker":
        start(lambda: make_runner(ns))
        return
    from banyan.bench.workload_args import workload_from_args

    _, run = make_runner(ns)
    from transformers import AutoConfig

    workload = workload_from_args(ns, AutoConfig.from_pretrained(ns.model).vocab_size)
    if workload.dependent:
        sys.exit(f"{ns.workload}: transformers peers run independent workloads only")
    prompts = [r.prompt_ids for r in workload.requests]
    result = run(prompts, [r.output_len for r in workload.requests])
    result["output_tok_s"] = result["output_tokens"] / result["elapsed_s"]
    text = json.dumps({"engine": f"hf-{ns.mode}", "workload": ns.workload,
                       "workload_params": workload.params, "result": result}, indent=2)
    print(text)
    if ns.out:
        Path(ns.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
