"""`banyan bench serve` against a real Banyan server on the tiny model: every record complete,
our token counts equal the server's usage (token-id, text and chat prompts), failed requests
counted and not crashed on, the concurrency cap held, and the CLI's JSON and PNG written."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from banyan.bench.serve import ServeOptions, arrival_times, run_serve
from banyan.bench.workloads import (
    from_prompts,
    multi_turn_workload,
    random_workload,
    shared_prefix_workload,
)
from tests.server_helpers import ServerProcess, free_port, running_server


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(llama_dir, tmp_path_factory.mktemp("bench-server")) as srv:
        yield srv


@pytest.fixture(scope="module")
def tokenizer(llama_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(llama_dir))


def opts(server: ServerProcess, **kw: Any) -> ServeOptions:
    return ServeOptions(base_url=server.url, progress=False, timeout_s=60, **kw)


def test_records_complete_and_counts_equal_usage(server: ServerProcess, tokenizer: Any) -> None:
    w = shared_prefix_workload(2, 3, 40, 6, 5, tokenizer.vocab_size, seed=1)
    run = run_serve(w, tokenizer, opts(server))
    assert run.model == "tiny"  # discovered from /v1/models
    assert len(run.records) == 6 and run.max_in_flight >= 1
    lens = w.prompt_lens()
    for r in run.records:
        assert r.success, r.error
        assert r.http_status == 200 and r.finish_reason == "length"
        assert r.prompt_tokens == lens[r.index] == r.server_prompt_tokens
        assert r.output_tokens == r.server_completion_tokens == r.max_tokens == 5
        assert r.ttft is not None and r.latency is not None and 0 < r.ttft <= r.latency
        assert len(r.itl) <= 4 and all(g >= 0 for g in r.itl)
        assert r.cached_tokens is not None and r.start >= 0
    # the cache was flushed before the run: the second and third prompt of a group hit
    cached = sum(r.cached_tokens or 0 for r in run.records)
    assert 0 < cached <= run.reusable_tokens == 2 * 2 * 40


@pytest.mark.parametrize("endpoint,fmt", [("completions", "text"), ("chat", "text")])
def test_text_prompts_counts_equal_usage(server: ServerProcess, tokenizer: Any,
                                         endpoint: str, fmt: str) -> None:
    w = multi_turn_workload(2, 3, 24, 6, 4, tokenizer.vocab_size, seed=2)
    run = run_serve(w, tokenizer, opts(server, endpoint=endpoint, prompt_format=fmt,
                                        concurrency=1))
    assert run.max_in_flight == 1
    by_index = {r.index: r for r in run.records}
    for r in run.records:
        assert r.success, r.error
        assert r.prompt_tokens == r.server_prompt_tokens
        assert r.server_completion_tokens == 4
        if r.parent is not None:  # turns of a conversation are sequential
            parent = by_index[r.parent]
            assert r.start >= parent.start + parent.latency - 1e-3
            assert r.prompt_tokens > parent.prompt_tokens
    if endpoint == "completions":  # text of exact token length: the ids workload's lengths
        assert [r.prompt_tokens for r in sorted(run.records, key=lambda r: r.index)] == \
            w.prompt_lens()


def test_failed_request_is_counted(server: ServerProcess, tokenizer: Any) -> None:
    ok = random_workload(3, 8, 3, tokenizer.vocab_size, seed=3)
    prompts = [r.prompt_ids for r in ok.requests] + [[5] * 1100]  # past the context length
    w = from_prompts("mixed", prompts, [3, 3, 3, 3])
    run = run_serve(w, tokenizer, opts(server, model="tiny"))
    failed = [r for r in run.records if not r.success]
    assert len(failed) == 1 and failed[0].index == 3
    assert failed[0].http_status == 400 and "HTTP 400" in (failed[0].error or "")
    assert all(r.success for r in run.records[:3])
    # a bad parameter fails every request, and nothing raises
    run = run_serve(ok, tokenizer, opts(server, model="tiny", extra_body={"top_p": 5}))
    assert [r.success for r in run.records] == [False] * 3


def test_refused_connection_is_counted(tokenizer: Any) -> None:
    w = random_workload(2, 8, 3, tokenizer.vocab_size, seed=4)
    o = ServeOptions(base_url=f"http://127.0.0.1:{free_port()}", model="m", progress=False,
                     warmup=False, flush_cache=False, timeout_s=5)
    run = run_serve(w, tokenizer, o)
    assert [r.success for r in run.records] == [False, False]
    assert all(r.error and "Connect" in r.error for r in run.records)


def test_arrival_times() -> None:
    assert arrival_times(3, math.inf, 0) == [0.0, 0.0, 0.0]
    times = arrival_times(200, 50.0, seed=7)
    assert times == arrival_times(200, 50.0, seed=7) and times[0] == 0.0
    assert all(a <= b for a, b in itertools.pairwise(times))
    assert 2.0 < times[-1] < 6.0  # about 199 / 50 s


def test_cli_writes_json_and_plot(server: ServerProcess, llama_dir: Path, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    from banyan.cli import main

    out, png = tmp_path / "r.json", tmp_path / "r.png"
    code = main(["bench", "serve", "--base-url", f"{server.url}/v1", "--model", "tiny",
                 "--tokenizer", str(llama_dir), "--workload", "tree-of-thought", "--trees", "1",
                 "--branches", "2", "--depth", "2", "--question-len", "12", "--output-len", "3",
                 "--request-rate", "100", "--seed", "5", "--disable-tqdm",
                 "--out", str(out), "--plot", str(png)])
    assert code == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["summary"]["completed"] == 6 and data["summary"]["failed"] == 0
    assert len(data["records"]) == 6 and data["workload_params"]["seed"] == 5
    assert data["summary"]["token_check"]["prompt_mismatches"] == 0
    assert {"ttft", "tpot", "itl", "cached_tokens"} <= set(data["records"][0])
    assert png.read_bytes()[:4] == b"\x89PNG"
