"""Issue #14: the API server's memory stays flat (within +-5%) over 10,000 refused requests.

Before the fix, a request whose values passed validation but could not be encoded for the
engine (an int above 2^64, a lone surrogate) left its request registered in the API server:
~8 KiB more per request. This starts a `banyan serve` on 127.0.0.1 (the demo model unless
--model is given), warms it up with the same mix of refusals, then sends --requests more and
compares the API server's resident memory before and after. Writes the result as JSON.

    python benchmarks/refused_requests_memory.py --out benchmarks/results/refused-memory.json
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

from banyan.bench.local_server import start_server, stop_server

LONE = "\\ud800"
REFUSED: list[tuple[str, str]] = [  # (path, raw JSON body): each must be refused with a 4xx
    ("/v1/completions", '{"prompt": "a", "seed": 36893488147419103232}'),
    ("/generate",
     '{"text": "a", "rid": "same", "sampling_params": {"top_k": 36893488147419103232}}'),
    ("/generate", f'{{"text": "a", "rid": "{LONE}"}}'),
    ("/v1/completions", f'{{"prompt": "a", "stop": "{LONE}"}}'),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "{LONE}"}}]}}'),
    ("/tokenize", f'{{"prompt": "{LONE}"}}'),
    ("/v1/completions", '{"prompt": "a", "max_tokens": true}'),
    ("/v1/completions", '{"prompt": "a", "model": "nope"}'),
    ("/v1/completions", '{"prompt": "' + "word " * 5000 + '"}'),  # longer than the context
]


def send_all(url: str, count: int, threads: int) -> dict[int, int]:
    statuses: dict[int, int] = {}
    with httpx.Client(timeout=60) as client:
        def one(i: int) -> int:
            path, body = REFUSED[i % len(REFUSED)]
            return client.post(url + path, content=body.encode(),
                               headers={"Content-Type": "application/json"}).status_code

        with ThreadPoolExecutor(threads) as pool:
            for status in pool.map(one, range(count)):
                statuses[status] = statuses.get(status, 0) + 1
    return statuses


def rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF folder (default: the demo model)")
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--warmup", type=int, default=2_000)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    serve = ["--log-level", "warning", "--max-model-len", "512", "--kv-cache-memory", "32MiB"]
    proc, url = start_server(serve + (["--model", args.model] if args.model else []))
    try:
        send_all(url, args.warmup, args.threads)
        before = rss(proc.pid)
        t0 = time.monotonic()
        statuses = send_all(url, args.requests, args.threads)
        elapsed = time.monotonic() - t0
        after = rss(proc.pid)
        change = (after - before) / before
        engine_requests = httpx.get(f"{url}/server_info").json()["num_requests"]
        result = {
            "requests": args.requests, "warmup": args.warmup, "threads": args.threads,
            "statuses": {str(k): v for k, v in sorted(statuses.items())},
            "rss_before_bytes": before, "rss_after_bytes": after,
            "rss_change_fraction": round(change, 4),
            "bytes_per_request": round((after - before) / args.requests, 1),
            "engine_requests_after": engine_requests, "seconds": round(elapsed, 1),
            "flat_within_5_percent": abs(change) <= 0.05
            and all(400 <= s < 500 for s in statuses),
        }
        print(json.dumps(result, indent=2))
        if args.out:
            args.out.write_text(json.dumps(result, indent=2) + "\n")
        return 0 if result["flat_within_5_percent"] else 1
    finally:
        stop_server(proc, 30)


if __name__ == "__main__":
    raise SystemExit(main())
