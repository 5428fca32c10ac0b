"""llama.cpp (`llama-cpp-python`) behind the worker protocol of run_side_by_side.py, run with the
python of a virtual environment that has it (it is not a project dependency; pip builds
llama.cpp from source):

    python -m venv ~/.cache/banyan-peers/llamacpp
    ~/.cache/banyan-peers/llamacpp/bin/pip install llama-cpp-python
    ~/.cache/banyan-peers/llamacpp/bin/python benchmarks/peers/llamacpp_worker.py --gguf FILE

llama-cpp-python's `Llama` holds one sequence: a run with several requests decodes them one
after another (what a llama-cpp-python user gets; llama.cpp's server batches, this binding
does not). Greedy, end of sequence ignored (the loop stops at each request's output length),
the same token ids as the other engines. Each request starts from an empty context
(`reset()`: no prefix reuse across requests, so shared-prefix runs recompute every prefix).
Threads: --threads (default every core) for both prompt and decode.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from worker_protocol import start, warmup_prompts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gguf", required=True, help="the GGUF file of the same weights")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--n-ctx", type=int, default=2048)
    ns = parser.parse_args()

    def load() -> tuple[dict[str, Any], Any]:
        import llama_cpp

        llm = llama_cpp.Llama(model_path=ns.gguf, n_threads=ns.threads,
                              n_threads_batch=ns.threads, n_ctx=ns.n_ctx, n_batch=512,
                              verbose=False)

        def one(prompt: list[int], out_len: int) -> int:
            llm.reset()
            produced = 0
            for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
                produced += 1
                if produced == out_len:
                    break
            return produced

        def run(prompts: list[list[int]], output_lens: list[int]) -> dict[str, Any]:
            t0 = time.perf_counter()
            produced = sum(one(p, o) for p, o in zip(prompts, output_lens, strict=True))
            return {"elapsed_s": time.perf_counter() - t0, "output_tokens": produced,
                    "cached_tokens": 0}

        run(warmup_prompts(llm.n_vocab()), [4] * 4)
        ready = {"engine": "llama.cpp", "version": llama_cpp.__version__,
                 "gguf": Path(ns.gguf).name, "gguf_bytes": os.path.getsize(ns.gguf),
                 "threads": ns.threads, "sequential": True}
        return ready, run

    start(load)


if __name__ == "__main__":
    main()
