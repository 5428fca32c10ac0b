"""Whether speculation changes greedy text: each prompt alone (batch 1), greedy, with speculation
off, then with `ngram` and with `draft` (the default model's GGUF file as the draft), on the
chat and input-grounded prompts of banyan bench; for each prompt, the first output position
where the speculated text parts from the plain one (None: equal throughout). --shared-prefix:
every prompt after the first grounded one's tokens (a long common prefix, as a system prompt
is) and all of them submitted at once, so that their decodes are grouped by the prefix while
speculated requests' checks run alone.

    python benchmarks/spec_exactness.py [--model DIR_OR_GGUF] [--dtype bfloat16]
        [--kv-cache-dtype auto] [--chat 6] [--grounded 4] [--output-len 160] [--shared-prefix]
        [--out F]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from banyan.bench.grounded import chat_workload, grounded_workload
from banyan.bench.offline import command_line, machine_info
from banyan.engine import Engine
from banyan.models.gguf_loader import default_model_file
from banyan.sampling.params import SamplingParams


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: Banyan's default model")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-dtype", default="auto", help="the pool's storage (both engines)")
    ap.add_argument("--chat", type=int, default=6)
    ap.add_argument("--grounded", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=160)
    ap.add_argument("--shared-prefix", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    ns = ap.parse_args()
    base: dict[str, Any] = dict(model=ns.model, dtype=ns.dtype, kv_cache_memory="1GiB",
                                kv_cache_dtype=ns.kv_cache_dtype, disable_tqdm=True)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=ns.output_len, ignore_eos=True)

    def lone(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
        if ns.shared_prefix:  # all at once
            return [o.outputs[0].output_ids for o in engine.generate(
                input_ids=prompts, sampling_params=greedy, use_tqdm=False)]
        return [engine.generate(input_ids=[p], sampling_params=greedy,
                                use_tqdm=False)[0].outputs[0].output_ids for p in prompts]

    with Engine(**base) as plain:
        tok = plain.tokenizer
        reqs = (chat_workload(tok, ns.chat, ns.output_len).requests
                + grounded_workload(tok, ns.grounded, ns.output_len).requests)
        prompts = [r.prompt_ids for r in reqs]
        if ns.shared_prefix:
            prompts = [prompts[ns.chat] + p for p in prompts]
        want = lone(plain, prompts)
    results: dict[str, Any] = {}
    for algorithm in ("ngram", "draft"):
        spec: dict[str, Any] = {"speculative_algorithm": algorithm}
        if algorithm == "draft":
            spec["spec_draft_model"] = str(default_model_file())
        with Engine(**base, **spec) as engine:
            got = lone(engine, prompts)
        parted = [first_difference(w, g) for w, g in zip(want, got)]
        results[algorithm] = {"first_difference": parted,
                              "equal": sum(p is None for p in parted), "prompts": len(parted)}
        print(f"{algorithm}: equal {results[algorithm]['equal']} of {len(parted)}; first "
              f"differing position per prompt {parted}", flush=True)
    if ns.out:
        ns.out.write_text(json.dumps({"command": command_line(),
                                      "machine": machine_info(), "dtype": ns.dtype,
                                      "kv_cache_dtype": ns.kv_cache_dtype,
                                      "shared_prefix": ns.shared_prefix,
                                      "output_len": ns.output_len, "results": results},
                                     indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
