"""The Markdown of run_side_by_side.py: per suite, each engine's median and spread and its
ratio to Banyan; Banyan with the prefix cache on vs off; batch-1 decode vs the bandwidth bound;
and where Banyan loses, by how much and where its time went (its step split)."""

from __future__ import annotations

from typing import Any

from banyan.bench.offline import cpu_label

NAMES = {"banyan": "Banyan", "banyan-nocache": "Banyan, prefix cache off",
         "vllm": "vLLM-CPU", "vllm-nocache": "vLLM-CPU, prefix caching off",
         "hf-generate": "transformers generate (static batch)",
         "hf-cb": "transformers continuous batching",
         "llamacpp": "llama.cpp (llama-cpp-python, one sequence at a time)"}


def _f(x: float | None, fmt: str = ".1f") -> str:
    return "—" if x is None else format(x, fmt)


def _paired(entry: dict[str, Any]) -> str:
    """Banyan over the engine repetition by repetition, e.g. `1.26 / 0.83 / 1.16 (1.16×)`."""
    ratios = entry.get("paired_ratios")
    if not ratios:
        return "—"
    return " / ".join(f"{x:.2f}" for x in ratios) + f" ({entry['paired_ratio_median']:.2f}×)"


def _split_line(entry: dict[str, Any]) -> str:
    split = entry.get("median_run", {}).get("step_split")
    if not split:
        return ""
    return (f"Banyan's time in its median run ({split['elapsed_s']:.2f} s, {split['steps']} "
            f"steps): busy {split['busy_fraction']:.0%} (forward {split['forward_s']:.2f} s, "
            f"sampling {split['sample_s']:.2f} s); idle: input preparation "
            f"{split['prepare_s']:.2f} s, scheduling {split['schedule_s']:.2f} s, output "
            f"processing {split['output_s']:.2f} s, waiting on the forward "
            f"{split['wait_s']:.2f} s, "
            f"driver {split['driver_s']:.2f} s.")


def write_report(data: dict[str, Any]) -> str:
    m = data["machine"]
    lines = [
        "# Banyan side by side with vLLM-CPU and transformers",
        "",
        f"- Command: `{data['command']}`",
        f"- Dates: {data['started']} to {data['finished']} ({data['wall_s'] / 60:.1f} min)",
        f"- Machine: {cpu_label(m)}, {m['cores']} cores, {m.get('memory')}; memory bandwidth "
        f"{data['memory_bandwidth_gbs']:.1f} GB/s (torch copy of 512 MiB, read + write, best of "
        "5; the median of the harness's samples before and after the runs: "
        + ", ".join(f"{b:.1f}" for b in data["memory_bandwidth_samples_gbs"]) + ")",
        f"- Model: `{data['model']}` (bfloat16 checkpoint), --dtype {data.get('dtype', 'bfloat16')}"
        "; greedy, ignore_eos, prompts as token ids",
        f"- Runs: engines alternate run by run (A, B, C, A, B, C, ...), {data['reps']} runs per "
        f"engine ({data.get('hf_reps', 1)} of transformers continuous batching, and of "
        "transformers on "
        "shared-prefix, for time); medians; each run starts with an empty prefix cache"
        + (f"; **{data['skipped_runs']} runs dropped** past the time limit"
           if data.get("skipped_runs") else ""),
        "- vLLM-CPU environment: " + ", ".join(f"`{k}={v}`"
                                               for k, v in data["thread_env"].items()),
    ]
    for e, info in data["engines"].items():
        ready = info.get("ready") or {}
        version = ready.get("version") or ready.get("transformers") or ""
        status = (f"started in {ready['startup_s']:.0f} s" if ready
                  else f"failed to start: {info['error']}")
        computes = f", computing in {ready['compute_dtype']}" if ready.get("compute_dtype") else ""
        lines.append(f"- {NAMES.get(e, e)}{' ' + version if version else ''}: {status}{computes}")
    losses: list[str] = []
    for suite in data["suites"]:
        entries = data["summary"].get(suite["name"], {})
        if not entries:
            continue
        base = entries.get("banyan", {}).get("output_tok_s")
        lines += ["", f"## {suite['title']}", "",
                  (f"{suite['requests']} request(s), {suite['prompt_tokens']} prompt tokens "
                   f"({suite['reusable_tokens']} reusable by a perfect prefix cache)."), "",
                  ("| engine | runs | median s | output tok/s (median) | range | Banyan ÷ engine "
                   "| run by run (median) | cached tokens | idle workers' CPU-s |"),
                  "|---|---|---|---|---|---|---|---|---|"]
        for engine, e in entries.items():
            if not e["ok"]:
                lines.append(f"| {NAMES.get(engine, engine)} | 0 of {e['runs']} | failed | | | "
                             "| | | |")
                continue
            ratio = base / e["output_tok_s"] if base and engine != "banyan" else None
            lines.append(
                f"| {NAMES.get(engine, engine)} | {e['ok']} | {e['elapsed_s']:.2f} "
                f"| {e['output_tok_s']:.1f} | {e['min_tok_s']:.1f}-{e['max_tok_s']:.1f} "
                f"| {_f(ratio, '.2f') + '×' if ratio else '—'} "
                f"| {_paired(e)} "
                "| "
                f"{_f(e.get('cached_tokens'), 'd') if e.get('cached_tokens') is not None else '—'} "
                f"| {e['background_cpu_s']:.1f} |")
            if ratio is not None and ratio < 1 and not engine.startswith("banyan"):
                losses.append(f"- {suite['title']}: Banyan reaches {ratio:.0%} of "
                              f"{NAMES.get(engine, engine)}'s output tokens/s "
                              f"({base:.1f} vs {e['output_tok_s']:.1f}); "
                              + _split_line(entries["banyan"]))
        if "banyan" in entries and entries["banyan"]["ok"]:
            lines += ["", _split_line(entries["banyan"])]
        if "banyan-nocache" in entries and base and entries["banyan-nocache"]["ok"]:
            off = entries["banyan-nocache"]
            lines += ["", (f"Banyan with the prefix cache on vs off: {base:.1f} vs "
                           f"{off['output_tok_s']:.1f} output tok/s, "
                           f"**{base / off['output_tok_s']:.2f}×** "
                           f"({entries['banyan'].get('cached_tokens')} of "
                           f"{suite['prompt_tokens']} prompt tokens from the cache).")]
        if suite["name"] == "batch1":
            lines += ["", *batch1_lines(data, entries)]
    lines += ["", "## Where Banyan loses", ""]
    lines += losses or ["Nowhere in these runs."]
    for suite, prof in (data.get("profiles") or {}).items():
        lines += ["", (f"Profile of Banyan on {suite} (one extra run under torch.profiler, "
                       f"{prof['elapsed_s']:.2f} s with its overhead; operators by self CPU "
                       "time, the calling thread's wall time):"), "",
                  "| operator | self s | share | calls |", "|---|---|---|---|"]
        lines += [f"| `{o['op']}` | {o['self_s']:.2f} | {o['share']:.0%} | {o['calls']} |"
                  for o in prof["top_ops"]]
        ops = prof.get("stack_ops") or {}
        inside = sum(ops.values())
        if inside > 0:  # the one call above, split by its own timers (none: the stack never ran)
            lines += ["", f"Inside `banyan::layer_stack` ({inside:.2f} s, its own timers): " +
                      ", ".join(f"{name} {sec:.2f} s ({sec / inside:.0%})" for name, sec in
                                sorted(ops.items(), key=lambda kv: -kv[1])) + "."]
    return "\n".join(lines) + "\n"


def batch1_lines(data: dict[str, Any], entries: dict[str, Any]) -> list[str]:
    ready = (data["engines"].get("banyan") or {}).get("ready") or {}
    weight_bytes = ready.get("weight_bytes")
    bw = data["memory_bandwidth_gbs"]
    if not weight_bytes:
        return []
    bound = bw * 1e9 / weight_bytes
    out = [(f"Batch-1 decode bound: {weight_bytes / 1e6:.0f} MB of weights read per token at "
            f"{bw:.1f} GB/s = **{bound:.0f} tok/s**."), "",
           "| engine | output tok/s (prefill included) | decode tok/s | of the bound |",
           "|---|---|---|---|"]
    for engine, e in entries.items():
        if not e["ok"]:
            continue
        decode = e.get("decode_tok_s")
        rate = decode or e["output_tok_s"]
        out.append(f"| {NAMES.get(engine, engine)} | {e['output_tok_s']:.1f} "
                   f"| {_f(decode)} | {rate / bound:.0%}{'' if decode else ' (output rate)'} |")
    return out
