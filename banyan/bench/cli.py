"""`banyan bench offline | serve` argument parsing and dispatch."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

from banyan.args import EngineArgs, add_dataclass_args, engine_args_from
from banyan.bench.workload_args import add_workload_args, workload_from_args, workload_vocab

logger = logging.getLogger(__name__)


def add_bench_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmarks")
    modes = bench.add_subparsers(dest="mode", required=True)

    off = modes.add_parser("offline", help="a workload through the in-process Engine")
    add_dataclass_args(off.add_argument_group("engine"), EngineArgs)
    add_workload_args(off, ("--bench-seed",))
    o = off.add_argument_group("offline")
    o.add_argument("--history", choices=["model", "scripted"], default="model",
                   help="dependent workloads: put the engine's answer (model) or the scripted "
                        "one (what bench serve sends) into the next prompt")
    o.add_argument("--batch1", action="store_true",
                   help="also time one request (input-len in / output-len out) and compare its "
                        "decode speed with the memory-bandwidth bound")
    _add_output_args(off)
    off.set_defaults(func=run_offline)

    from banyan.bench.quality import add_quality_parser

    add_quality_parser(modes)

    srv = modes.add_parser("serve", help="a workload against an OpenAI-compatible server")
    s = srv.add_argument_group("server")
    s.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:30000 (or .../v1)")
    s.add_argument("--model", default=None,
                   help="model name in the API (default: the first one /v1/models lists)")
    s.add_argument("--tokenizer", required=True,
                   help="local tokenizer folder (the served model's), for prompts and counts")
    s.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    s.add_argument("--prompt-format", choices=["ids", "text"], default="ids",
                   help="completions: send token ids (exact) or text of exact token length")
    s.add_argument("--request-rate", type=float, default=math.inf,
                   help="new conversations per second, Poisson arrivals (default: all at once)")
    s.add_argument("--concurrency", type=int, default=None, help="most requests in flight")
    s.add_argument("--api-key", default=None)
    s.add_argument("--timeout", type=float, default=3600.0, help="seconds per request")
    s.add_argument("--extra-body", type=json.loads, default={},
                   help='JSON merged into every request body, e.g. \'{"top_k": 1}\'')
    s.add_argument("--vocab-size", type=int, default=None,
                   help="draw prompt ids below this (default: the tokenizer's vocabulary)")
    s.add_argument("--no-warmup", action="store_true", help="skip the unrecorded first request")
    s.add_argument("--no-flush-cache", action="store_true",
                   help="keep the server's prefix cache (by default the run starts by asking "
                        "for /flush_cache or /reset_prefix_cache, so that an earlier run of the "
                        "same workload does not count as hits)")
    add_workload_args(srv, ("--seed", "--bench-seed"))
    _add_output_args(srv)
    srv.set_defaults(func=run_serve_cmd)


def _add_output_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("output")
    g.add_argument("--out", default=None, help="write the JSON result (every request) here")
    g.add_argument("--plot", default=None, help="write a PNG of latencies and throughput here")
    g.add_argument("--json", action="store_true", help="also print the JSON result")
    if not any(a.dest == "disable_tqdm" for a in parser._actions):
        g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def run_offline(ns: argparse.Namespace) -> int:
    from banyan.bench.offline import bandwidth_bound, batch1, machine_info, run_workload
    from banyan.bench.report import format_table, plot, write_json
    from banyan.bench.workloads import random_workload
    from banyan.engine import Engine

    args = engine_args_from(ns)
    engine = Engine(**dataclasses.asdict(args))
    vocab = workload_vocab(engine.tokenizer, engine.core.vocab_size)
    workload = workload_from_args(ns, vocab, engine.tokenizer)
    warm = random_workload(4, 32, 4, vocab, seed=12345)
    run_workload(engine, warm, use_tqdm=False)  # first-call costs stay out of the timing
    engine.core.flush_cache()  # the warm-up's prompts must not count as hits
    engine.core.populate_kv()  # as a server does while idle (and vLLM at start-up)
    result = run_workload(engine, workload, history=ns.history, use_tqdm=True)
    records = result.pop("records")
    out: dict[str, Any] = {
        "mode": "offline", "workload": ns.workload, "workload_params": workload.params,
        "reusable_tokens": result["reusable_tokens"],
        "engine_args": dataclasses.asdict(args), "compute_dtype": engine.core.dtype,
        "machine": machine_info(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "result": result,
    }
    if ns.batch1:
        out["batch1"] = batch1(engine, ns.input_len, ns.output_len, vocab)
        out["batch1"].update(bandwidth_bound(engine, out["batch1"]["decode_tok_s"]))
    out["records"] = records
    info = {"Workload": f"{ns.workload} ({len(workload.requests)} requests)",
            "Engine": f"banyan offline, {engine.core.dtype} (--dtype {args.dtype}), "
                      f"prefix cache {'off' if args.no_prefix_cache else 'on'}"}
    if result.get("speculative"):
        s = result["speculative"]
        info["Speculative"] = (f"{args.speculative_algorithm}: acceptance length "
                               f"{s['mean_acceptance_length']:.2f}, {s['num_accepted_tokens']}/"
                               f"{s['num_draft_tokens']} guesses accepted, per position "
                               + " ".join(f"{r:.2f}" for r in s["per_position_rate"]))
    if result.get("hicache"):
        h = result["hicache"]
        info["KV tier"] = (f"{h['loaded_tokens']:.0f} tokens loaded ({h['loaded_bytes'] / 1e6:.0f}"
                           f" MB in {h['load_seconds']:.2f} s), {h['saved_blocks']:.0f} blocks "
                           f"saved, {h['recompute_preferred']:.0f} hits recomputed instead")
    if "batch1" in out:
        b = out["batch1"]
        info["Batch-1 decode (tok/s)"] = (f"{b['decode_tok_s']:.1f} of bound "
                                          f"{b['decode_bound_tok_s']:.0f} "
                                          f"({b['fraction_of_bound']:.0%})")
    print(format_table("Offline Benchmark Result", info, result["summary"],
                       result["step_split"]))
    write_json(out, ns.out, echo=ns.json)
    if ns.plot:
        plot(records, f"banyan offline: {ns.workload}", ns.plot)
    return 0


def run_serve_cmd(ns: argparse.Namespace) -> int:
    from banyan.bench.metrics import summarize
    from banyan.bench.offline import machine_info
    from banyan.bench.pd_split import ttft_split
    from banyan.bench.report import format_table, plot, write_json
    from banyan.bench.serve import ServeOptions, run_serve
    from banyan.model_files import load_tokenizer

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per request
    try:
        tokenizer = load_tokenizer(Path(ns.tokenizer))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    vocab = ns.vocab_size or workload_vocab(tokenizer)
    workload = workload_from_args(ns, vocab)
    opts = ServeOptions(
        base_url=ns.base_url, model=ns.model, endpoint=ns.endpoint,
        prompt_format=ns.prompt_format, request_rate=ns.request_rate,
        concurrency=ns.concurrency, seed=ns.bench_seed, timeout_s=ns.timeout,
        api_key=ns.api_key, extra_body=ns.extra_body, warmup=not ns.no_warmup,
        flush_cache=not ns.no_flush_cache, progress=not ns.disable_tqdm)
    try:
        run = run_serve(workload, tokenizer, opts)
    except Exception as exc:  # noqa: BLE001 - unreachable server, bad model list, ...
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    summary = summarize(run.records, run.duration_s, run.reusable_tokens)
    ttft = summary.get("ttft_ms") or {}
    pd = ttft_split(*run.pd_counters, ttft["mean"] / 1e3 if "mean" in ttft else None)
    if pd is not None:
        summary["pd_ttft_split"] = pd
    out = {
        "mode": "serve", "base_url": ns.base_url, "model": run.model, "endpoint": ns.endpoint,
        "prompt_format": ns.prompt_format if ns.endpoint == "completions" else "chat",
        "request_rate": None if math.isinf(ns.request_rate) else ns.request_rate,
        "concurrency": ns.concurrency, "max_in_flight": run.max_in_flight,
        "workload": ns.workload, "workload_params": workload.params,
        "reusable_tokens": run.reusable_tokens, "client_machine": machine_info(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "summary": summary,
        "records": run.records,
    }
    rate = "inf" if math.isinf(ns.request_rate) else f"{ns.request_rate:g}/s"
    info = {"Workload": f"{ns.workload} ({len(workload.requests)} requests)",
            "Server": f"{ns.base_url} ({run.model})",
            "Endpoint": f"{ns.endpoint}" + (f", prompts as {ns.prompt_format}"
                                            if ns.endpoint == "completions" else ""),
            "Request rate / concurrency cap": f"{rate} / {ns.concurrency or 'none'}",
            "Most requests in flight": run.max_in_flight}
    if pd is not None:
        info["P/D TTFT prefill/transfer/decode (s)"] = (
            f"{pd['prefill_s']:.3f} / {pd['transfer_s']:.3f} / {pd['first_decode_s']:.3f}")
    print(format_table("Serving Benchmark Result", info, summary))
    write_json(out, ns.out, echo=ns.json)
    if ns.plot:
        plot(run.records, f"bench serve: {ns.workload} on {run.model}", ns.plot)
    return 0 if summary["completed"] else 1
