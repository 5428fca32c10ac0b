"""Batch-1 streaming decode speed of a running `banyan serve`, as a client sees it.

    banyan serve --port 46001 [--quantization ...] &
    python benchmarks/served_stream_speed.py --port 46001 --label NAME [--reps 3]

One greedy completion of 128 tokens (ignore_eos) streamed REPS times; per run the chunks per
second after the first one. Prints one JSON line: label, the server's quantization, the rates.
"""

from __future__ import annotations

import argparse
import json
import time

import httpx

PROMPT = "Once upon a time in a small village by the sea,"


def stream_rate(url: str, model: str, tokens: int) -> float:
    body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    first, n = None, 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:])["choices"]
            if choices and choices[0].get("text") is not None:
                n += 1
                first = first or time.perf_counter()
    assert first is not None and n > 1
    return (n - 1) / (time.perf_counter() - first)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=46001)
    ap.add_argument("--label", default="")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ns = ap.parse_args()
    url = f"http://127.0.0.1:{ns.port}"
    info = httpx.get(f"{url}/server_info", timeout=30).json()
    rates = [stream_rate(url, info["model"], ns.tokens) for _ in range(ns.reps)]
    print(json.dumps({"label": ns.label, "quantization": info["quantization"],
                      "chunks_per_s": [round(r, 1) for r in rates]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
