"""`banyan bench offline`: a workload through banyan.Engine in-process, stepped by our own loop
so that every step's timing (the scheduler's `last_step`) adds up to the busy/idle split, and
every request gets the same record as in `bench serve` (TTFT, ITL at step granularity)."""

from __future__ import annotations

import itertools
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from banyan.bench.metrics import RequestRecord, summarize
from banyan.bench.report import write_json
from banyan.bench.workloads import Workload
from banyan.scheduler.speculation import SpecStats
from banyan.sampling.params import SamplingParams

_run_ids = itertools.count()


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


CPU_FEATURES = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                "amx_bf16", "amx_int8", "amx_tile")


def command_line() -> str:
    """This process's command line as a benchmark's JSON records it: `python ...`, the home
    directory as ~ (no machine's paths in committed results)."""
    return " ".join(["python", *sys.argv]).replace(str(Path.home()), "~")


def machine_info() -> dict[str, Any]:
    import os

    import torch

    from banyan.kernels import native

    cpu = platform.processor()
    memory = None
    family = model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "model name" and cpu == platform.processor():
                cpu = value
            elif key == "cpu family" and family is None:
                family = value
            elif key == "model" and model is None:
                model = value
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                memory = f"{int(line.split()[1]) / 1024**2:.1f} GiB"
                break
    except OSError:
        pass
    # what decides which kernels run: AVX-512 (BF16, VNNI) and AMX, or only AVX2
    isa = [f for f in native.cpu_flags().split() if f in CPU_FEATURES]
    return {"cpu": cpu, "cpu_family_model": f"{family}/{model}", "isa": isa,
            "cores": os.cpu_count(), "memory": memory,
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def cpu_label(machine: dict[str, Any]) -> str:
    """machine_info()'s CPU in one line, for reports: "AMD EPYC (family 25 model 17; avx2,
    avx512f, ...; no AMX)" (its model name alone does not tell Zen 4 from Zen 5)."""
    family, _, model = str(machine.get("cpu_family_model", "")).partition("/")
    isa = list(machine.get("isa", []))
    amx = "AMX" if any(f.startswith("amx") for f in isa) else "no AMX"
    return (f"{machine['cpu']} (family {family} model {model}; "
            f"{', '.join(f for f in isa if not f.startswith('amx')) or 'no AVX2'}; {amx})")


@dataclass(slots=True)
class StepSplit:
    """Seconds summed over the engine's loop turns, by phase (the scheduler's StepStats).

    The engine thread's turn is schedule + prepare + wait + output (+ other); the forward and
    the sampler run inside `wait` when sequential, and beside the engine thread (a worker)
    with overlap, so they are counted apart, as the busy time."""

    steps: int = 0
    wall_s: float = 0.0  # inside engine.step()
    schedule_s: float = 0.0
    prepare_s: float = 0.0
    wait_s: float = 0.0  # the engine thread inside the runner, not preparing: the forward, or
    # waiting on it
    output_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0

    def add(self, stats: Any, wall: float) -> None:
        self.steps += 1
        self.wall_s += wall
        self.schedule_s += stats.schedule
        self.output_s += stats.output
        timings = stats.timings or {}
        self.prepare_s += stats.launch  # launch prepares on the engine thread and returns
        self.wait_s += stats.wait
        self.forward_s += timings.get("forward", 0.0)
        self.sample_s += timings.get("sample", 0.0)

    def to_dict(self, elapsed: float) -> dict[str, Any]:
        """Busy: the device computing (forward and sampling, the server's definition); the
        rest of the wall time is execution-idle. host_s: the engine thread's own work per
        turn (schedule, prepare, output), which overlap hides behind the forward."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        busy = self.forward_s + self.sample_s
        out.update(elapsed_s=elapsed, busy_s=busy,
                   busy_fraction=min(busy / elapsed, 1.0) if elapsed > 0 else 0.0,
                   host_s=self.schedule_s + self.prepare_s + self.output_s,
                   step_other_s=max(self.wall_s - self.schedule_s - self.prepare_s
                                    - self.wait_s - self.output_s, 0.0),
                   driver_s=max(elapsed - self.wall_s, 0.0))
        out["idle_fraction"] = 1.0 - out["busy_fraction"]
        return out


def run_workload(engine: Any, workload: Workload, history: str = "model",
                 use_tqdm: bool = True) -> dict[str, Any]:
    """Run a workload to completion: every root at once, each dependent request as soon as
    the one it continues has ended, with the engine's answer in the history (history="model")
    or the scripted one ("scripted", what `bench serve` sends). Returns throughput, the
    latency summary, the busy/idle split, and the per-request records under "records"."""
    from tqdm import tqdm

    if history not in ("model", "scripted"):
        raise ValueError(f"history must be model or scripted, got {history!r}")
    reqs = workload.requests
    kids = workload.children()
    records = [RequestRecord(i, 0, r.output_len, r.group, r.parent) for i, r in enumerate(reqs)]
    prompts: dict[int, list[int]] = {}
    outputs: dict[int, list[int]] = {}
    conv: dict[int, list[int]] = {}
    last_token: dict[int, float] = {}
    retractions0 = engine.core.stats().retractions
    spec0 = _spec_counts(engine)
    tier0 = engine.core.stats().tier
    split = StepSplit()
    prefix = f"bench{next(_run_ids)}-"
    bar = tqdm(total=len(reqs), desc="bench offline", unit="req",
               disable=not use_tqdm or engine.args.disable_tqdm)
    t0 = time.perf_counter()

    def submit(i: int) -> None:
        prompt = prompts[i] = workload.prompt(i, conv)
        outputs[i] = []
        records[i].prompt_tokens = len(prompt)
        records[i].start = time.perf_counter() - t0
        params = SamplingParams(max_new_tokens=reqs[i].output_len, temperature=0.0,
                                ignore_eos=not workload.stop_at_eos)
        engine.add_request(input_ids=prompt, params=params, request_id=f"{prefix}{i}")

    pending = 0
    try:
        for i in workload.roots():
            submit(i)
            pending += 1
        while pending:
            t_step = time.perf_counter()
            updates = engine.step()
            now = time.perf_counter()
            split.add(engine.core.last_step, now - t_step)
            for u in updates:
                if not u.rid.startswith(prefix):
                    continue
                i = int(u.rid[len(prefix):])
                rec = records[i]
                rec.cached_tokens = max(rec.cached_tokens or 0, u.cached_tokens)
                if u.new_token_ids:
                    outputs[i].extend(u.new_token_ids)
                    if rec.ttft is None:
                        rec.ttft = now - t0 - rec.start
                    else:  # a gap a token, as the server's metrics count them: an update of
                        # several (a burst of decode steps, accepted guesses) shares its gap
                        n = len(u.new_token_ids)
                        rec.itl.extend([(now - last_token[i]) / n] * n)
                    last_token[i] = now
                if u.finish_reason is None:
                    continue
                pending -= 1
                bar.update(1)
                rec.latency = now - t0 - rec.start
                rec.output_tokens = len(outputs[i])
                rec.finish_reason = u.finish_reason.value
                rec.error = u.error
                rec.success = u.error is None and rec.finish_reason != "abort"
                if kids[i]:
                    answer = outputs[i] if history == "model" else reqs[i].answer_ids
                    conv[i] = prompts[i] + list(answer)
                    for child in kids[i]:
                        submit(child)
                        pending += 1
    except BaseException:
        engine.close()
        raise
    finally:
        bar.close()
    elapsed = time.perf_counter() - t0
    reusable = workload.reusable(history)
    summary = summarize(records, elapsed, reusable)
    return {
        "elapsed_s": elapsed,
        "requests": len(records),
        "failed": summary["failed"],
        "prompt_tokens": summary["prompt_tokens"],
        "output_tokens": summary["output_tokens"],
        "output_tok_s": summary["output_tok_s"],
        "total_tok_s": summary["total_tok_s"],
        "cached_tokens": summary["cached_tokens"] or 0,
        "prefix_hit_rate": summary["prefix_hit_rate"],
        "hit_rate_vs_optimum": summary["hit_rate_vs_optimum"],
        "retractions": engine.core.stats().retractions - retractions0,
        "history": history if workload.dependent else None,
        "reusable_tokens": reusable,
        "summary": summary,
        "step_split": split.to_dict(elapsed),
        "speculative": _spec_delta(spec0, _spec_counts(engine)),
        "hicache": _counter_delta(tier0, engine.core.stats().tier),
        "records": records,
    }


def _spec_counts(engine: Any) -> SpecStats | None:
    spec = engine.core.stats().spec
    return None if spec is None else spec.copy()


def _spec_delta(before: SpecStats | None, after: SpecStats | None) -> dict[str, Any] | None:
    """Speculation's counters over one run: drafts, guesses, accepted, acceptance length."""
    return None if before is None or after is None else after.since(before).as_dict()


def _counter_delta(before: dict[str, float] | None,
                   after: dict[str, float] | None) -> dict[str, float] | None:
    """The KV tier's counters over one run (sizes as they are at the end)."""
    if before is None or after is None:
        return None
    sizes = ("files", "bytes_used", "budget_bytes", "block_tokens", "read_bytes_per_s",
             "compute_tokens_per_s")
    return {k: v if k in sizes else v - before.get(k, 0) for k, v in after.items()}


def run_multi_turn(engine: Any, workload: Workload) -> dict[str, Any]:
    """Kept for callers of the old name: multi-turn is an ordinary dependent workload now."""
    return run_workload(engine, workload)


def batch1(engine: Any, input_len: int, output_len: int, vocab: int,
           on_first_token: Callable[[], None] | None = None) -> dict[str, float]:
    """One request alone: time to first token and decode speed. on_first_token: called as the
    first token arrives, before the decode clock starts (a profile of the decode steps alone)."""
    from banyan.bench.workloads import random_workload

    req = random_workload(1, input_len, output_len, vocab, seed=7).requests[0]
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    first = None
    n = 0
    for chunk in engine.stream(input_ids=req.prompt_ids, sampling_params=params):
        n += len(chunk.token_ids)
        if first is None and chunk.token_ids:
            if on_first_token is not None:
                on_first_token()
            first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    return {"elapsed_s": end - t0, "ttft_s": first - t0, "output_tokens": n,
            "output_tok_s": n / (end - t0), "decode_tok_s": (n - 1) / (end - first)}


def bandwidth_bound(engine: Any, decode_tok_s: float) -> dict[str, float]:
    """The batch-1 decode bound: every token reads all weights once, at the copy bandwidth."""
    bw = memory_bandwidth_gbs()
    weight_bytes = engine.core.weight_bytes
    bound = bw * 1e9 / weight_bytes if weight_bytes else float("nan")
    return {"memory_bandwidth_gbs": bw, "weight_bytes": weight_bytes,
            "decode_bound_tok_s": bound, "fraction_of_bound": decode_tok_s / bound}


def write_result(result: dict[str, Any], out: str | None, echo: bool = True) -> None:
    write_json(result, out, echo)
