"""Banyan's side of run_side_by_side.py: the offline banyan.Engine behind the worker protocol.

    .venv/bin/python benchmarks/peers/banyan_worker.py --model DIR \\
        [--engine-args '{"no_prefix_cache": true}']

Each run goes through banyan.bench.offline.run_workload (the driver of `banyan bench offline`):
all requests at once, greedy, ignore_eos, prefix cache flushed first.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from worker_protocol import start, warmup_prompts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-memory", default="4GiB")
    parser.add_argument("--engine-args", type=json.loads, default={},
                        help="more banyan.Engine keyword arguments, as JSON")
    ns = parser.parse_args()

    def load() -> tuple[dict[str, Any], Any]:
        # the engine's start-up verdicts (the AMX tile routes' probes, the linear methods) into
        # the worker's log: one probe decides a path for the whole run
        logging.basicConfig(stream=sys.stderr, level=logging.WARNING,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        logging.getLogger("banyan").setLevel(logging.INFO)
        from banyan.bench.offline import machine_info, memory_bandwidth_gbs, run_workload
        from banyan.bench.workloads import from_prompts
        from banyan.engine import Engine

        engine = Engine(model=ns.model, dtype=ns.dtype, kv_cache_memory=ns.kv_cache_memory,
                        disable_tqdm=True, **ns.engine_args)
        vocab = engine.core.vocab_size

        def run(prompts: list[list[int]], output_lens: list[int]) -> dict[str, Any]:
            engine.flush_cache()
            res = run_workload(engine, from_prompts("run", prompts, output_lens),
                               use_tqdm=False)
            records = res.pop("records")
            out = {k: res[k] for k in ("elapsed_s", "output_tokens", "cached_tokens",
                                       "retractions", "failed")}
            split = res["step_split"]
            out["busy_fraction"] = split["busy_fraction"]
            out["step_split"] = split
            out["ttft_ms_p50"] = (res["summary"]["ttft_ms"] or {}).get("p50")
            if len(records) == 1 and records[0].output_tokens > 1:
                r = records[0]
                out["decode_tok_s"] = (r.output_tokens - 1) / (r.latency - r.ttft)
            return out

        def profile(prompts: list[list[int]], output_lens: list[int]) -> dict[str, Any]:
            """One run under torch.profiler: where the time goes, by operator."""
            import torch
            from torch.profiler import ProfilerActivity

            stack = engine.core.scheduler.runner.model_runner.stack  # one call to the profiler
            if stack is not None:
                stack.time_ops()  # so it times its own ops
            with torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
                out = run(prompts, output_lens)
            stack_ops = stack.op_seconds() if stack is not None else {}
            if stack is not None:
                stack.time_ops(False)
            events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
            total = sum(e.self_cpu_time_total for e in events) or 1.0
            events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
            top = [{"op": e.key, "self_s": e.self_cpu_time_total / 1e6, "calls": e.count,
                    "share": e.self_cpu_time_total / total} for e in events[:12]]
            return {"elapsed_s": out["elapsed_s"], "step_split": out["step_split"],
                    "profiled_op_s": total / 1e6, "top_ops": top, "stack_ops": stack_ops}

        run(warmup_prompts(vocab), [4] * 4)
        engine.core.populate_kv()  # the pool's pages, as a server faults them in while idle
        ready = {"engine": "banyan", "args": vars(ns), "machine": machine_info(),
                 "memory_bandwidth_gbs": memory_bandwidth_gbs(),
                 "weight_bytes": engine.core.weight_bytes,
                 "compute_dtype": engine.core.dtype}
        return ready, run, profile

    start(load)


if __name__ == "__main__":
    main()
