"""`banyan bench offline ...` argument parsing and dispatch."""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any


def add_bench_parser(sub: Any) -> None:
    from banyan.args import EngineArgs
    from banyan.cli import add_dataclass_args

    bench = sub.add_parser("bench", help="benchmarks")
    modes = bench.add_subparsers(dest="mode", required=True)
    off = modes.add_parser("offline", help="a workload through the in-process Engine")
    add_dataclass_args(off.add_argument_group("engine"), EngineArgs)
    w = off.add_argument_group("workload")
    w.add_argument("--workload", choices=["random", "shared-prefix", "multi-turn"],
                   default="random")
    w.add_argument("--num-requests", type=int, default=64)
    w.add_argument("--input-len", type=int, default=128)
    w.add_argument("--output-len", type=int, default=128)
    w.add_argument("--range-ratio", type=float, default=1.0)
    w.add_argument("--groups", type=int, default=8)
    w.add_argument("--prompts-per-group", type=int, default=8)
    w.add_argument("--system-len", type=int, default=1024)
    w.add_argument("--question-len", type=int, default=64)
    w.add_argument("--conversations", type=int, default=8)
    w.add_argument("--turns", type=int, default=4)
    w.add_argument("--no-shuffle", action="store_true",
                   help="shared-prefix: submit groups in order instead of shuffled")
    w.add_argument("--bench-seed", type=int, default=0)
    w.add_argument("--batch1", action="store_true",
                   help="also time one request (input-len in / output-len out) and compare its "
                        "decode speed with the memory-bandwidth bound")
    w.add_argument("--out", default=None, help="write the JSON result here")
    off.set_defaults(func=run_offline)


def run_offline(ns: argparse.Namespace) -> int:
    from banyan.bench.offline import (
        machine_info,
        memory_bandwidth_gbs,
        run_multi_turn,
        run_workload,
        write_result,
    )
    from banyan.bench.workloads import (
        multi_turn_workload,
        random_workload,
        shared_prefix_workload,
    )
    from banyan.cli import engine_args_from
    from banyan.engine import Engine

    args = engine_args_from(ns)
    engine = Engine(**dataclasses.asdict(args))
    vocab = engine.core.vocab_size
    if ns.workload == "random":
        workload = random_workload(ns.num_requests, ns.input_len, ns.output_len, vocab,
                                   ns.range_ratio, ns.bench_seed)
    elif ns.workload == "shared-prefix":
        workload = shared_prefix_workload(ns.groups, ns.prompts_per_group, ns.system_len,
                                          ns.question_len, ns.output_len, vocab, ns.bench_seed,
                                          shuffle=not ns.no_shuffle)
    else:
        workload = multi_turn_workload(ns.conversations, ns.turns, ns.system_len,
                                       ns.question_len, ns.output_len, vocab, ns.bench_seed)
    warm = random_workload(4, 32, 4, vocab, seed=12345)
    run_workload(engine, warm)  # first-call costs (allocator warm-up, lazy init) stay out
    engine.core.scheduler.kv.cache.flush()  # the warm-up's prompts must not count as hits
    runner = run_multi_turn if ns.workload == "multi-turn" else run_workload
    result: dict[str, Any] = {
        "workload": ns.workload, "workload_params": workload.params,
        "engine_args": dataclasses.asdict(args), "machine": machine_info(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "result": runner(engine, workload),
    }
    if ns.batch1:
        result["batch1"] = batch1(engine, ns.input_len, ns.output_len, vocab)
        bw = memory_bandwidth_gbs()
        weight_bytes = engine.core.weight_bytes
        bound = bw * 1e9 / weight_bytes
        result["batch1"].update(memory_bandwidth_gbs=bw, weight_bytes=weight_bytes,
                                decode_bound_tok_s=bound,
                                fraction_of_bound=result["batch1"]["decode_tok_s"] / bound)
    write_result(result, ns.out)
    return 0


def batch1(engine: Any, input_len: int, output_len: int, vocab: int) -> dict[str, float]:
    from banyan.bench.workloads import random_workload
    from banyan.sampling.params import SamplingParams

    req = random_workload(1, input_len, output_len, vocab, seed=7).requests[0]
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    first = None
    n = 0
    for chunk in engine.stream(input_ids=req.prompt_ids, sampling_params=params):
        n += len(chunk.token_ids)
        if first is None and chunk.token_ids:
            first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    return {"elapsed_s": end - t0, "ttft_s": first - t0, "output_tokens": n,
            "output_tok_s": n / (end - t0), "decode_tok_s": (n - 1) / (end - first)}
