"""Speculative decoding at batch 1, side by side in one process: one engine per configuration
(none, ngram with the default number of guesses a step or --configs' ngram-kN, optionally a
draft), the grounded and chat workloads run on each in turn, round after round, so every ratio
compares runs a few seconds apart (this machine's speed drifts by 20-40% over minutes; separate
processes minutes apart measured the drift, not speculation).

    python benchmarks/spec_side_by_side.py [--model DIR|FILE] [--dtype bfloat16] [--rounds 5] \
        [--configs none,ngram,ngram-k4,draft,draft-c0,draft-qint4] [--draft DIR|FILE] \
        [--draft-quantization auto] \
        [--load] [--concurrent 2,4,8] [--out FILE]

Per configuration and workload: output tokens/s of each round (prefill included, the prefix
cache flushed before each run), the median of the per-round ratios to "none", and the
acceptance statistics (vLLM's names). The grounded workload's answers end at EOS (what a user
is sent; every configuration produces the same greedy tokens); chat runs to --output-len.
With --load, a second engine per configuration (no batch limit) runs random 64 x 128/128 too:
speculation under load, where the adaptive rule should turn it off; with --concurrent 2,4,
chat with 2 and with 4 requests at once (engines of that batch limit), where guessing pays
less than at batch 1 and a draft model's forwards may cost more than they bring.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from banyan import Engine
from banyan.args import QUANTIZATION_CHOICES
from banyan.bench.grounded import chat_workload, grounded_workload
from banyan.bench.offline import machine_info, run_workload
from banyan.bench.workloads import random_workload


def config(name: str) -> dict[str, Any]:
    """Engine arguments of a configuration: none, ngram or draft (the engine's defaults), with
    -kN: at most N guesses a step, for ngram -mN: --spec-ngram-min N, and for draft -cF:
    --spec-draft-min-confidence F, -qQ: the
    draft's weights in Q instead of --draft-quantization, -l0 / -l1: --spec-draft-no-lookup /
    the lookup on, -h0: the draft's guesses from its full head, not its 4-bit pick (draft-k8-c0:
    8 guesses, however unsure; draft-qint4: the draft model quantized to int4 at load)."""
    algorithm, *options = name.split("-")
    extra: dict[str, Any] = {"speculative_algorithm": algorithm}
    for option in options:
        value = option[1:]
        if algorithm != "none" and option.startswith("k") and value.isdigit():
            extra["speculative_num_tokens"] = int(value)
        elif algorithm == "ngram" and option.startswith("m") and value.isdigit():
            extra["spec_ngram_min"] = int(value)
        elif algorithm == "draft" and option.startswith("c") and _is_float(value):
            extra["spec_draft_min_confidence"] = float(value)
        elif algorithm == "draft" and option.startswith("q") and value in QUANTIZATION_CHOICES:
            extra["spec_draft_quantization"] = value
        elif algorithm == "draft" and option in ("l0", "l1"):
            extra["spec_draft_no_lookup"] = option == "l0"
        elif algorithm == "draft" and option == "h0":
            extra["plain_head"] = True  # (not an engine argument: build() takes it)
        else:
            algorithm = "?"
    if algorithm not in ("none", "ngram", "draft"):
        raise SystemExit(f"unknown configuration {name!r}: none, ngram[-kN][-mN], "
                         "draft[-kN][-cF][-qQ][-l0|-l1][-h0]")
    return extra


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: Banyan's default model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--configs", default="none,ngram,ngram-k4")
    parser.add_argument("--draft", default=None, help="draft model (the 'draft' config)")
    parser.add_argument("--draft-quantization", default="auto")
    parser.add_argument("--num-requests", type=int, default=5)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--load", action="store_true", help="also random 64 x 128/128")
    parser.add_argument("--concurrent", default="", help="also chat with N requests at once "
                        "(N,M,...: a workload chat-xN each, on engines of that batch limit)")
    parser.add_argument("--out", type=Path, default=None)
    ns = parser.parse_args()
    names = ns.configs.split(",")
    if "none" not in names:
        raise SystemExit("--configs must include none (the ratios' base)")

    def build(name: str, **limits: Any) -> Engine:
        extra = config(name)
        plain_head = extra.pop("plain_head", False)
        if extra["speculative_algorithm"] == "draft":
            extra.setdefault("spec_draft_quantization", ns.draft_quantization)
            extra["spec_draft_model"] = ns.draft or ns.model
        engine = Engine(model=ns.model, dtype=ns.dtype, disable_tqdm=True, **limits, **extra)
        if plain_head:  # the draft's guesses from its full head's logits (spec/draft_head.py)
            engine.core.scheduler.speculation.proposer.head = None
        return engine

    engines = {name: build(name, max_running_requests=1, kv_cache_memory="512MiB")
               for name in names}
    built = list(engines.values())
    tokenizer = engines["none"].tokenizer
    workloads = {"grounded": grounded_workload(tokenizer, ns.num_requests, ns.output_len),
                 "chat": chat_workload(tokenizer, ns.num_requests, ns.output_len)}
    engines_for = {w: engines for w in workloads}
    if ns.load:
        workloads["load"] = random_workload(64, 128, 128, engines["none"].core.vocab_size, seed=0)
        engines_for["load"] = {name: build(name, kv_cache_memory="2GiB") for name in names}
        built += engines_for["load"].values()
    for n in (int(x) for x in ns.concurrent.split(",") if x):
        workloads[f"chat-x{n}"] = chat_workload(tokenizer, n, ns.output_len)
        engines_for[f"chat-x{n}"] = {name: build(name, max_running_requests=n,
                                                 kv_cache_memory="1GiB") for name in names}
        built += engines_for[f"chat-x{n}"].values()
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {w: {n: [] for n in names}
                                                        for w in workloads}
    for engine in built:  # the pools' pages, as a server faults them in while idle
        engine.core.populate_kv()
    for wname in engines_for:  # warm: first allocations
        if wname == "grounded":
            continue
        for engine in engines_for[wname].values():
            run_workload(engine, workloads[wname], use_tqdm=False)
    for r in range(ns.rounds):
        for wname, workload in workloads.items():
            # every other round in reverse (A B C, C B A): a drift of the machine's speed within
            # a round favours no configuration
            order = list(engines_for[wname].items())
            for name, engine in order if r % 2 == 0 else order[::-1]:
                engine.flush_cache()
                res = run_workload(engine, workload, use_tqdm=False)
                runs[wname][name].append({"output_tok_s": res["output_tok_s"],
                                          "output_tokens": res["output_tokens"],
                                          "speculative": res["speculative"]})
                print(f"round {r + 1} {wname:8s} {name:9s} {res['output_tok_s']:7.1f} tok/s",
                      flush=True)
    summary: dict[str, dict[str, Any]] = {}
    for wname, by_config in runs.items():
        base = [x["output_tok_s"] for x in by_config["none"]]
        summary[wname] = {}
        for name, rounds in by_config.items():
            rates = [x["output_tok_s"] for x in rounds]
            spec = rounds[-1]["speculative"]
            ratios = [a / b for a, b in zip(rates, base, strict=True)]
            row = summary[wname][name] = {
                "median_tok_s": round(statistics.median(rates), 1),
                "ratio_to_none_median": round(statistics.median(ratios), 3),
                "ratios": [round(x, 3) for x in ratios],
                "output_tokens": rounds[-1]["output_tokens"],
                "mean_acceptance_length": spec.get("mean_acceptance_length") if spec else None}
            print(f"{wname:8s} {name:9s} median {row['median_tok_s']:7.1f} tok/s, "
                  f"x{row['ratio_to_none_median']:.2f} of none "
                  f"(acceptance length {row['mean_acceptance_length']})")
    flags = [f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}")
             for k, v in vars(ns).items() if v not in (None, False, "") and k != "out"]
    out = {"command": "python benchmarks/spec_side_by_side.py " + " ".join(flags).replace(
               str(Path.home()), "~"),
           "machine": machine_info(), "summary": summary, "runs": runs}
    for engine in built:
        engine.close()
    if ns.out:
        ns.out.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
