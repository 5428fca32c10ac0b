"""`banyan bench offline`: a workload through banyan.Engine in-process."""

from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from banyan.bench.workloads import MultiTurnWorkload, Workload
from banyan.sampling.params import SamplingParams


def memory_bandwidth_gbs(size_mib: int = 512, repeats: int = 5) -> float:
    """Copy bandwidth with torch (bytes read + written per second), the best of a few copies."""
    import torch

    n = size_mib * 1024 * 1024 // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * n * 4 / best / 1e9


def machine_info() -> dict[str, Any]:
    import os

    import torch

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def run_workload(engine: Any, workload: Workload) -> dict[str, Any]:
    """Submit every request at once and run to completion; throughput and the step split."""
    params = [SamplingParams(max_new_tokens=r.output_len, temperature=0.0, ignore_eos=True)
              for r in workload.requests]
    stats = engine.core.scheduler
    retractions0 = stats.total_retractions
    t0 = time.perf_counter()
    outputs = engine.generate(input_ids=[r.prompt_ids for r in workload.requests],
                              sampling_params=params, use_tqdm=True)
    elapsed = time.perf_counter() - t0
    out_tokens = sum(o.completion_tokens for o in outputs)
    cached = sum(o.cached_tokens for o in outputs)
    return {
        "elapsed_s": elapsed,
        "requests": len(outputs),
        "prompt_tokens": workload.prompt_tokens,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / elapsed,
        "total_tok_s": (out_tokens + workload.prompt_tokens) / elapsed,
        "cached_tokens": cached,
        "hit_rate_vs_optimum": cached / workload.reusable_tokens if workload.reusable_tokens else None,
        "retractions": stats.total_retractions - retractions0,
    }


def run_multi_turn(engine: Any, workload: MultiTurnWorkload) -> dict[str, Any]:
    """All conversations advance one turn per round (a round is one batch); turn t's prompt is
    the history: every earlier message and answer, then the new message."""
    params = SamplingParams(max_new_tokens=workload.output_len, temperature=0.0, ignore_eos=True)
    histories = [[] for _ in workload.system]  # type: list[list[int]]
    prompt_tokens = out_tokens = cached = reusable = 0
    t0 = time.perf_counter()
    for turn in range(len(workload.messages[0])):
        prompts = []
        for c, history in enumerate(histories):
            if turn == 0:
                history.extend(workload.system[c])
            reusable += max(0, len(history) - 1) if turn else 0
            history.extend(workload.messages[c][turn])
            prompts.append(list(history))
        outputs = engine.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)
        for history, prompt, out in zip(histories, prompts, outputs):
            history.extend(out.output_ids)
            prompt_tokens += len(prompt)
            out_tokens += out.completion_tokens
            cached += out.cached_tokens
    elapsed = time.perf_counter() - t0
    return {"elapsed_s": elapsed, "requests": len(histories) * len(workload.messages[0]),
            "prompt_tokens": prompt_tokens, "output_tokens": out_tokens,
            "output_tok_s": out_tokens / elapsed,
            "total_tok_s": (out_tokens + prompt_tokens) / elapsed, "cached_tokens": cached,
            "hit_rate_vs_optimum": cached / reusable if reusable else None}


def write_result(result: dict[str, Any], out: str | None) -> None:
    result = {"command": " ".join(["banyan"] + sys.argv[1:]), **result}
    text = json.dumps(result, indent=2, default=lambda o: asdict(o) if hasattr(o, "__slots__") else str(o))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    print(text)
