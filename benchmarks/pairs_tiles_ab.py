"""A dense bf16 model's short steps on AMX tiles or on the vector loop, end to end at batch 1,
in one process: the same engines (no speculation, ngram, a draft) run the grounded and chat
workloads with the GEMM's dense pairs taking the tiles from the first token
(gemm_tiles.PAIRS_TILES_FROM, the default) and from BF16_GEMM_MIN_TOKENS (before: decodes and
speculative checks on the vector loop), the two settings alternating round by round (ABBA), so
each ratio compares runs a few seconds apart on this drifting VM.

    python benchmarks/pairs_tiles_ab.py --model DIR --draft FILE [--rounds 4] [--out FILE]

Only where the process's GEMM mode is AMX's tiles (an AMX Xeon whose tiles checked out).
Within one setting a token's bits do not depend on the step's size, so speculation stays exact
in both; the two settings' bits differ (their texts may part at near-ties).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from banyan import Engine
from banyan.bench.grounded import chat_workload, grounded_workload
from banyan.bench.offline import command_line, machine_info, run_workload
from banyan.attention.decode_tiles import ASK
from banyan.layers.gemm_tiles import PAIRS_TILES_FROM, set_gemm_tiles
from banyan.layers.quant import BF16_GEMM_MIN_TOKENS
from spec_side_by_side import config  # (this script's folder)

SETTINGS = {"tiles": PAIRS_TILES_FROM, "vector": BF16_GEMM_MIN_TOKENS}  # name -> pairs_from


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None, help="draft model (default: --model)")
    ap.add_argument("--configs", default="none,ngram,draft")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--num-requests", type=int, default=5)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--out", type=Path, default=None)
    ns = ap.parse_args()
    engines: dict[str, Engine] = {}
    for name in ns.configs.split(","):
        extra = config(name)
        if extra["speculative_algorithm"] == "draft":
            extra["spec_draft_model"] = ns.draft or ns.model
        engines[name] = Engine(model=ns.model, dtype="bfloat16", disable_tqdm=True,
                               max_running_requests=1, kv_cache_memory="512MiB", **extra)
    if set_gemm_tiles(ASK) != 2:
        print("the GEMM's mode here is not AMX's tiles: nothing to compare")
        return 1
    tokenizer = engines["none"].tokenizer
    workloads = {"grounded": grounded_workload(tokenizer, ns.num_requests, ns.output_len),
                 "chat": chat_workload(tokenizer, ns.num_requests, ns.output_len)}
    for engine in engines.values():
        engine.core.populate_kv()
        run_workload(engine, workloads["chat"], use_tqdm=False)  # warm
    rates: dict[str, dict[str, dict[str, list[float]]]] = {
        w: {n: {s: [] for s in SETTINGS} for n in engines} for w in workloads}
    for r in range(ns.rounds):
        order = list(SETTINGS.items())
        for setting, pairs_from in order if r % 2 == 0 else order[::-1]:
            set_gemm_tiles(2, pairs_from=pairs_from)
            for wname, workload in workloads.items():
                for name, engine in engines.items():
                    engine.flush_cache()
                    res = run_workload(engine, workload, use_tqdm=False)
                    rates[wname][name][setting].append(res["output_tok_s"])
                    print(f"round {r + 1} {setting:6s} {wname:8s} {name:6s} "
                          f"{res['output_tok_s']:7.1f} tok/s", flush=True)
    set_gemm_tiles(2)
    summary: dict[str, Any] = {}
    for wname, by_config in rates.items():
        for name, by_setting in by_config.items():
            tiles, vector = by_setting["tiles"], by_setting["vector"]
            none_t, none_v = rates[wname]["none"]["tiles"], rates[wname]["none"]["vector"]
            row = summary.setdefault(wname, {})[name] = {
                "median_tok_s": {s: round(statistics.median(v), 1) for s, v in by_setting.items()},
                "tiles_over_vector_by_round": [round(a / b, 3) for a, b in zip(tiles, vector)],
                "over_none_by_round": {
                    "tiles": [round(a / b, 3) for a, b in zip(tiles, none_t)],
                    "vector": [round(a / b, 3) for a, b in zip(vector, none_v)]}}
            row["tiles_over_vector_median"] = statistics.median(row["tiles_over_vector_by_round"])
            print(wname, name, json.dumps(row))
    for engine in engines.values():
        engine.close()
    out = {"command": command_line(), "machine": machine_info(), "rounds": ns.rounds,
           "summary": summary, "tok_s": rates}
    if ns.out:
        ns.out.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
