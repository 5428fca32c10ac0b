"""Where a batch-1 decode step's time goes on a GPU (bench.py --diagnose): the same request
under the overlap loop and without it, with Python's thread switch interval at its 5 ms
default and at 0.1 ms, the step itself timed apart from the engine loop, and a torch.profiler
table of a few decode steps (host and device time per operator) written beside the results.

The first GPU run (H200, 2026-12-04) gave 350 and 359 tok/s at batch 1 for a 135M and a 1.2B
model alike: ~2.8 ms a token that the model's size does not explain; the second found the GPU
busy 1.4-1.7 ms a step with ~25 small element-wise kernels a layer. So this also runs the fused
element-wise Triton kernels (kernels/triton_fused.py, BANYAN_TRITON_FUSED) off and on,
alternating, at batch 1 and random 64, and profiles a step with them."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from banyan import Engine, SamplingParams
from banyan.bench.offline import batch1, run_workload
from banyan.bench.workloads import random_workload
from banyan.kernels import fused_ops


def small_engine(folder: Path, device: str, **kw: Any) -> Engine:
    """An engine for one request at a time (bf16; EngineArgs fields in kw)."""
    return Engine(str(folder), dtype="bfloat16", device=device, disable_tqdm=True,
                  kv_cache_memory="1GiB", max_running_requests=4, **kw)


def decode_ms(engine: Engine, tokens: int) -> float:
    """Batch-1 decode ms a token over `tokens` tokens, after a short warm-up request."""
    vocab = engine.core.vocab_size
    batch1(engine, 32, 8, vocab)
    return 1e3 / batch1(engine, 128, tokens, vocab)["decode_tok_s"]


def _on_cuda(engine: Engine) -> bool:
    return engine.core.scheduler.runner.model_runner.device.type == "cuda"


def _sync(engine: Engine) -> None:
    if _on_cuda(engine):
        torch.cuda.synchronize()


def step_ms(engine: Engine, tokens: int) -> dict[str, float]:
    """One request stepped by hand with overlap off: per decode step, the engine's step()
    wall time, and its split (schedule, the runner's prepare, forward launch, sample: the
    sample waits for the GPU, output)."""
    engine.add_request(input_ids=list(range(5, 133)), params=SamplingParams(
        max_new_tokens=tokens + 4, temperature=0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    _sync(engine)
    split = dict.fromkeys(("schedule", "prepare", "forward", "sample", "output"), 0.0)
    t0 = time.perf_counter()
    for _ in range(tokens):
        engine.step()
        stats = engine.core.scheduler.last_step
        split["schedule"] += stats.schedule
        split["prepare"] += stats.launch
        split["output"] += stats.output
        for k in ("forward", "sample"):
            split[k] += stats.timings.get(k, 0.0)
    wall = time.perf_counter() - t0
    while engine.core.has_work:
        engine.step()
    return {"step_ms": 1e3 * wall / tokens, **{f"{k}_ms": 1e3 * v / tokens
                                                for k, v in split.items()}}


def profile(engine: Engine, out: Path, tokens: int = 16) -> None:
    engine.add_request(input_ids=list(range(5, 69)), params=SamplingParams(
        max_new_tokens=tokens + 4, temperature=0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    acts = [torch.profiler.ProfilerActivity.CPU]
    if _on_cuda(engine):
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(tokens):
            engine.step()
        _sync(engine)
    while engine.core.has_work:
        engine.step()
    avg = prof.key_averages()
    tables = [avg.table(sort_by="self_cpu_time_total", row_limit=40)]
    if _on_cuda(engine):
        tables.append(avg.table(sort_by="self_device_time_total", row_limit=25))
    out.write_text("\n\n".join(tables))


def set_triton_fused(on: bool) -> None:
    os.environ["BANYAN_TRITON_FUSED"] = "1" if on else "0"
    fused_ops.triton_fused_enabled.cache_clear()


def fused_ab(folder: Path, device: str, quick: bool, rounds: int = 2) -> dict[str, Any]:
    """The fused element-wise Triton kernels (BANYAN_TRITON_FUSED) off and on, alternating:
    batch-1 ms a token (sequential and overlapped) and random 64 x 128/128 output tok/s."""
    tokens, n = (32, 16) if quick else (128, 64)
    result: dict[str, list[float]] = {}
    for _ in range(rounds):
        for on in (False, True):
            set_triton_fused(on)
            tag = "fused" if on else "unfused"
            for overlap in ("off", "on"):
                with small_engine(folder, device, overlap=overlap) as engine:
                    result.setdefault(f"{tag}_batch1_overlap_{overlap}_ms", []).append(
                        decode_ms(engine, tokens))
            with Engine(str(folder), dtype="bfloat16", device=device, disable_tqdm=True,
                        kv_cache_memory="8GiB", max_running_requests=64) as engine:
                work = random_workload(n, 128, 128, engine.core.vocab_size, seed=1)
                run_workload(engine, work, use_tqdm=False)  # compiles, captures
                result.setdefault(f"{tag}_random_tok_s", []).append(
                    run_workload(engine, work, use_tqdm=False)["output_tok_s"])
    set_triton_fused(False)
    return result


def diagnose(folder: Path, device: str, out: Path, quick: bool) -> dict[str, Any]:
    tokens = 32 if quick else 128
    result: dict[str, Any] = {}
    for name, kw in (("overlap", {"overlap": "on"}), ("sequential", {"overlap": "off"})):
        for interval in (0.005, 0.0001):
            sys.setswitchinterval(interval)
            with small_engine(folder, device, **kw) as engine:
                result[f"{name}_switch_{interval * 1e3:g}ms_ms_per_token"] = \
                    decode_ms(engine, tokens)
    sys.setswitchinterval(0.005)
    with small_engine(folder, device, overlap="off") as engine:
        result["sequential_steps"] = step_ms(engine, tokens)
        profile(engine, out)
    result["triton_fused_ab"] = fused_ab(folder, device, quick)
    set_triton_fused(True)
    with small_engine(folder, device, overlap="off") as engine:
        result["sequential_steps_fused"] = step_ms(engine, tokens)
        profile(engine, out.with_name(out.stem + "-fused.txt"))
    set_triton_fused(False)
    return result
