"""The end-of-run table (one screen), the JSON result, and the PNG of latency distributions and
throughput over time."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from banyan.bench.metrics import RequestRecord, percentile

WIDTH = 64


def _line(label: str, value: object) -> str:
    return f"{label + ':':<40}{value}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def format_table(title: str, info: dict[str, Any], summary: dict[str, Any],
                 split: dict[str, Any] | None = None) -> str:
    """A one-screen table: what ran, throughput, cache, token checks, latency percentiles,
    and (offline) the engine's busy/idle split."""
    s = summary
    rows = [f" {title} ".center(WIDTH, "=")]
    rows += [_line(k, v) for k, v in info.items()]
    rows += [
        _line("Successful requests", s["completed"]),
        _line("Failed requests", s["failed"]),
        _line("Duration (s)", f"{s['duration_s']:.2f}"),
        _line("Input tokens / output tokens", f"{s['prompt_tokens']} / {s['output_tokens']}"),
        _line("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        _line("Input token throughput (tok/s)", f"{s['input_tok_s']:.1f}"),
        _line("Output token throughput (tok/s)", f"{s['output_tok_s']:.1f}"),
        _line("Total token throughput (tok/s)", f"{s['total_tok_s']:.1f}"),
    ]
    if s.get("cached_tokens") is not None:
        rows.append(_line("Prefix cache hit rate (of optimum)",
                          f"{_pct(s['prefix_hit_rate'])} ({_pct(s['hit_rate_vs_optimum'])})"))
    else:
        rows.append(_line("Prefix cache hit rate", "not reported by the server"))
    tc = s.get("token_check")
    if tc and (tc["prompt_checked"] or tc["output_checked"]):
        rows.append(_line("Token counts vs server usage",
                          f"prompt {tc['prompt_checked'] - tc['prompt_mismatches']}/"
                          f"{tc['prompt_checked']} equal, output "
                          f"{tc['output_checked'] - tc['output_mismatches']}/"
                          f"{tc['output_checked']} equal"))
    for err, n in list(s.get("errors", {}).items())[:3]:
        rows.append(_line(f"  failed x{n}", err[:WIDTH - 16]))
    rows.append(" Latency (ms) ".center(WIDTH, "-"))
    rows.append(f"{'':<8}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}")
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"),
                      ("E2E", "e2e_latency_ms")):
        d = s.get(key)
        if d:
            rows.append(f"{name:<8}" + "".join(f"{d[k]:>10.1f}"
                                               for k in ("mean", "p50", "p90", "p99", "max")))
        else:
            rows.append(f"{name:<8}{'n/a':>10}")
    if split:
        rows.append(" Engine steps (s) ".center(WIDTH, "-"))
        rows.append(_line("Steps", split["steps"]))
        rows.append(_line("Busy: forward + sample", f"{split['busy_s']:.2f} "
                          f"({_pct(split['busy_fraction'])} of wall)"))
        rows.append(_line("Host: schedule / prepare / output", f"{split['schedule_s']:.2f} / "
                          f"{split['prepare_s']:.2f} / {split['output_s']:.2f}"))
        rows.append(_line("Engine waits on forward / driver", f"{split['wait_s']:.2f} / "
                          f"{split['driver_s']:.2f}"))
    rows.append("=" * WIDTH)
    return "\n".join(rows)


def write_json(result: dict[str, Any], out: str | None, echo: bool = False) -> None:
    result = {"command": " ".join(["banyan"] + sys.argv[1:]), **result}
    text = json.dumps(result, indent=2, default=_default)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    if echo:
        print(text)


def _default(obj: object) -> object:
    if isinstance(obj, RequestRecord):
        return obj.to_json()
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)  # type: ignore[arg-type]
    return str(obj)


def token_times(rec: RequestRecord) -> list[float]:
    """Approximate arrival time (from the start of the run) of each output token: the chunk
    times, each chunk's share of the request's tokens spread evenly over its chunks."""
    if not rec.success or rec.ttft is None:
        return []
    chunks = [rec.start + rec.ttft]
    for gap in rec.itl:
        chunks.append(chunks[-1] + gap)
    n = max(rec.output_tokens, 1)
    return [chunks[min(int(k * len(chunks) / n), len(chunks) - 1)] for k in range(n)]


def plot(records: Sequence[RequestRecord], title: str, path: str) -> None:
    """2x2 PNG: TTFT, TPOT and ITL distributions; output tokens/s and requests in flight over
    time (1-second bins)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if r.success]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    series = [("TTFT (ms)", [r.ttft * 1000 for r in ok if r.ttft is not None]),
              ("TPOT (ms)", [r.tpot * 1000 for r in ok if r.tpot is not None]),
              ("ITL (ms)", [g * 1000 for r in ok for g in r.itl])]
    for ax, (label, values) in zip(axes.flat, series):
        if values:
            ax.hist(values, bins=min(50, max(5, len(values) // 4)), color="tab:green")
            for q, style in ((50, "-"), (99, "--")):
                v = percentile(values, q)
                ax.axvline(v, color="black", linestyle=style, label=f"p{q} {v:.1f}")
            ax.legend()
        ax.set_xlabel(label)
        ax.set_ylabel("count")
    ax = axes.flat[3]
    times = [t for r in ok for t in token_times(r)]
    end = max([r.start + (r.latency or 0) for r in records] + [1.0])
    bins = max(1, int(end) + 1)
    if times:
        ax.hist(times, bins=bins, range=(0, bins), color="tab:blue", label="output tok/s")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("output tokens / s")
    twin = ax.twinx()
    grid = [b + 0.5 for b in range(bins)]
    twin.plot(grid, [sum(1 for r in records if r.latency is not None and r.start <= t
                         < r.start + r.latency) for t in grid], color="tab:red")
    twin.set_ylabel("requests in flight", color="tab:red")
    twin.set_ylim(bottom=0)
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
