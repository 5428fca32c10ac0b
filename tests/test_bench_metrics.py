"""Benchmark metric math on hand-made records: percentiles, TPOT, ITL pooling, throughput,
hit rates, failures, and the token-count cross-check; the report table and plot render."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from banyan.bench.metrics import RequestRecord, distribution, percentile, summarize
from banyan.bench.report import format_table, plot, token_times


def rec(index: int, **kw: object) -> RequestRecord:
    base: dict[str, object] = dict(prompt_tokens=10, max_tokens=5, success=True)
    base.update(kw)
    return RequestRecord(index, **base)  # type: ignore[arg-type]


def test_percentile_matches_numpy() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10.0], 99) == 10.0
    assert percentile([3, 1, 2], 0) == 1 and percentile([3, 1, 2], 100) == 3
    assert percentile([0, 10], 90) == pytest.approx(9.0)
    values = [0.3, 7.1, 2.2, 9.9, 4.4, 5.5, 1.0]
    for q in (1, 25, 50, 90, 99):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    with pytest.raises(ValueError):
        percentile([], 50)


def test_distribution_in_ms() -> None:
    d = distribution([0.1, 0.2, 0.3, 0.4])
    assert d is not None
    assert d["mean"] == pytest.approx(250.0)
    assert d["p50"] == pytest.approx(250.0)
    assert d["p90"] == pytest.approx(370.0)
    assert d["max"] == pytest.approx(400.0)
    assert distribution([]) is None


def test_tpot() -> None:
    # 5 tokens: the first after 0.2 s, the other 4 over the next 0.8 s
    assert rec(0, ttft=0.2, latency=1.0, output_tokens=5).tpot == pytest.approx(0.2)
    assert rec(0, ttft=0.2, latency=1.0, output_tokens=1).tpot is None
    assert rec(0, ttft=0.2, latency=1.0, output_tokens=5, success=False).tpot is None


def test_summary_of_hand_made_records() -> None:
    records = [
        rec(0, ttft=0.1, latency=0.5, output_tokens=5, itl=[0.1, 0.1, 0.1, 0.1],
            cached_tokens=0, server_prompt_tokens=10, server_completion_tokens=5),
        rec(1, ttft=0.3, latency=1.1, output_tokens=5, itl=[0.2, 0.2, 0.2, 0.2],
            cached_tokens=6, server_prompt_tokens=10, server_completion_tokens=5),
        rec(2, prompt_tokens=20, ttft=None, latency=0.01, output_tokens=0, success=False,
            error="HTTP 400: bad", http_status=400),
    ]
    s = summarize(records, duration=2.0, reusable_tokens=8)
    assert (s["requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["errors"] == {"HTTP 400: bad": 1}
    assert s["prompt_tokens"] == 20 and s["output_tokens"] == 10  # failed ones count nothing
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["input_tok_s"] == pytest.approx(10.0)
    assert s["output_tok_s"] == pytest.approx(5.0)
    assert s["total_tok_s"] == pytest.approx(15.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["ttft_ms"]["p99"] == pytest.approx(298.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(150.0)  # (0.4/4 + 0.8/4) / 2
    assert s["itl_ms"]["mean"] == pytest.approx(150.0)  # pooled over 8 gaps
    assert s["itl_ms"]["p50"] == pytest.approx(150.0)
    assert s["e2e_latency_ms"]["max"] == pytest.approx(1100.0)
    assert s["cached_tokens"] == 6
    assert s["prefix_hit_rate"] == pytest.approx(6 / 20)
    assert s["hit_rate_vs_optimum"] == pytest.approx(6 / 8)
    assert s["token_check"] == {"prompt_checked": 2, "prompt_mismatches": 0,
                                "output_checked": 2, "output_mismatches": 0}


def test_token_check_counts_mismatches_and_missing_usage() -> None:
    records = [rec(0, server_prompt_tokens=11, server_completion_tokens=5),
               rec(1, server_prompt_tokens=10, server_completion_tokens=4),
               rec(2)]  # a server that gives no usage: not checked, no cache figure
    s = summarize(records, duration=1.0)
    assert s["token_check"] == {"prompt_checked": 2, "prompt_mismatches": 1,
                                "output_checked": 2, "output_mismatches": 1}
    assert s["cached_tokens"] is None and s["prefix_hit_rate"] is None
    assert s["ttft_ms"] is None and s["tpot_ms"] is None


def test_token_check_of_answers_that_may_end_at_eos() -> None:
    """Without ignore_eos (a workload of real tasks) fewer tokens are fine, more are not."""
    records = [rec(0, server_prompt_tokens=10, server_completion_tokens=3),
               rec(1, server_prompt_tokens=10, server_completion_tokens=6)]
    for r in records:
        r.exact = False
    s = summarize(records, duration=1.0)
    assert s["token_check"]["output_checked"] == 2 and s["token_check"]["output_mismatches"] == 1


def test_all_failed_and_zero_duration() -> None:
    s = summarize([rec(0, success=False, error="x")], duration=0.0)
    assert s["completed"] == 0 and s["output_tok_s"] == 0.0 and s["failed"] == 1


def test_token_times_spread_chunks() -> None:
    r = rec(0, start=1.0, ttft=0.5, itl=[0.25], output_tokens=4, latency=1.0)
    assert token_times(r) == [1.5, 1.5, 1.75, 1.75]
    assert token_times(rec(0, success=False)) == []


def test_table_and_plot_render(tmp_path: Path) -> None:
    records = [rec(i, start=0.1 * i, ttft=0.1, latency=0.5, output_tokens=5,
                   itl=[0.1] * 4, cached_tokens=i) for i in range(6)]
    records.append(rec(6, success=False, error="HTTP 500: boom"))
    s = summarize(records, 1.2, reusable_tokens=30)
    split = {"steps": 3, "busy_s": 1.0, "busy_fraction": 0.8, "schedule_s": 0.1,
             "prepare_s": 0.1, "output_s": 0.05, "wait_s": 0.0, "driver_s": 0.05}
    table = format_table("T", {"Workload": "w"}, s, split)
    assert "Failed requests:" in table and "HTTP 500: boom" in table and "TPOT" in table
    assert len(table.splitlines()) < 40  # one screen
    out = tmp_path / "p.png"
    plot(records, "t", str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
