"""Do long prompts stall the requests decoding beside them? Colocated vs prefill/decode
disaggregation, side by side in one run on this machine.

Each setup is started the real way (`banyan serve ...` on localhost) and gets the same load:
  - `--chats` closed-loop chat streams: a fresh short prompt (--chat-prompt tokens), --chat-output
    tokens streamed, again, for the whole phase;
  - phase "quiet" (--quiet-s): only those (the decode-only inter-token latency);
  - phase "long" (--long-s): also a long prompt (--long-prompt tokens, fresh: nothing cached)
    every --long-every seconds, --long-output tokens each.
Reported per setup and phase: p50/p99/max inter-token latency of the chat streams (gaps between
streamed tokens), their tokens/s, and the long prompts' TTFT.

Setups (all with --num-threads 2 in total):
  colocated  one replica, two threads;
  dp2        two one-thread replicas behind the cache-aware router (`serve --dp 2`);
  pd         a one-thread prefill and a one-thread decode replica behind `route --pd`
             (`serve --pd 1:1`), K/V over ZMQ;
  pd-mooncake  the same, K/V written by Mooncake's transfer engine.

    python benchmarks/pd_interference.py [--model DIR] [--dtype float32] [--setups colocated,dp2,pd]
        [--out FILE] [--note TEXT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from banyan.bench.local_server import start_server, stop_server
from banyan.bench.offline import command_line, machine_info

SETUPS = {"colocated": [], "dp2": ["--dp", "2"], "pd": ["--pd", "1:1"],
          "pd-mooncake": ["--pd", "1:1", "--disaggregation-transfer-backend", "mooncake"]}


def start(setup: str, ns: argparse.Namespace, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    args = ["--dtype", ns.dtype, "--num-threads", "2", "--kv-cache-memory", ns.kv,
            "--disable-tqdm", "--log-level", "warning", *SETUPS[setup]]
    return start_server(args + (["--model", ns.model] if ns.model else []), log)


async def stream(client: httpx.AsyncClient, url: str, prompt: list[int],
                 max_tokens: int) -> tuple[float, list[float]]:
    """TTFT and the gaps between the streamed tokens."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    t0 = time.perf_counter()
    times: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
    return times[0] - t0, [b - a for a, b in zip(times, times[1:])]


async def phase(url: str, ns: argparse.Namespace, seconds: float, long_prompts: bool,
                rng: random.Random) -> dict[str, Any]:
    gaps: list[float] = []
    chat_tokens = 0
    long_ttft: list[float] = []
    end = time.perf_counter() + seconds

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    async with httpx.AsyncClient(timeout=600) as client:
        async def chat() -> None:
            nonlocal chat_tokens
            while time.perf_counter() < end:
                _, g = await stream(client, url, ids(ns.chat_prompt), ns.chat_output)
                gaps.extend(g)
                chat_tokens += len(g) + 1

        async def longs() -> None:
            tasks = []
            while time.perf_counter() < end - ns.long_every / 2:
                tasks.append(asyncio.create_task(
                    stream(client, url, ids(ns.long_prompt), ns.long_output)))
                await asyncio.sleep(ns.long_every)
            for ttft, _ in await asyncio.gather(*tasks):
                long_ttft.append(ttft)

        t0 = time.perf_counter()
        jobs = [chat() for _ in range(ns.chats)] + ([longs()] if long_prompts else [])
        await asyncio.gather(*jobs)
        wall = time.perf_counter() - t0
    gaps.sort()

    def q(p: float) -> float:
        return gaps[min(int(p * len(gaps)), len(gaps) - 1)] * 1e3

    median = gaps[len(gaps) // 2]
    stalls = [g - median for g in gaps if g > 2 * median]
    return {"itl_p50_ms": q(0.5), "itl_p90_ms": q(0.9), "itl_p99_ms": q(0.99),
            "itl_p999_ms": q(0.999), "itl_max_ms": gaps[-1] * 1e3,
            # gaps over twice the median, and the time they lost beyond it, summed
            "stalled_gaps": len(stalls), "stall_s": sum(stalls),
            "itl_mean_ms": statistics.fmean(gaps) * 1e3,
            "chat_tokens_per_s": chat_tokens / wall, "gaps": len(gaps),
            "long_prompts": len(long_ttft),
            "long_ttft_s": sorted(long_ttft), "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the real SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv", default="1GiB", help="--kv-cache-memory of each replica")
    ap.add_argument("--setups", default="colocated,dp2,pd")
    ap.add_argument("--chats", type=int, default=4)
    ap.add_argument("--chat-prompt", type=int, default=64)
    ap.add_argument("--chat-output", type=int, default=64)
    ap.add_argument("--long-prompt", type=int, default=3000)
    ap.add_argument("--long-output", type=int, default=8)
    ap.add_argument("--long-every", type=float, default=8.0)
    ap.add_argument("--quiet-s", type=float, default=20.0)
    ap.add_argument("--long-s", type=float, default=48.0)
    ap.add_argument("--note", default="")
    ap.add_argument("--out", default=None)
    ns = ap.parse_args(argv)
    logs = Path("benchmarks/results/logs")
    logs.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    for setup in ns.setups.split(","):
        proc, url = start(setup, ns, logs / f"pd-interference-{setup}.log")
        try:
            rng = random.Random(0)
            asyncio.run(phase(url, ns, 5.0, False, rng))  # warm-up
            results[setup] = {"quiet": asyncio.run(phase(url, ns, ns.quiet_s, False, rng)),
                              "long": asyncio.run(phase(url, ns, ns.long_s, True, rng))}
            if setup == "pd":
                results[setup]["server_info"] = _pd_info(url)
        finally:
            stop_server(proc)
        r = results[setup]
        print(f"{setup:10s} quiet p50/p99/p99.9 {r['quiet']['itl_p50_ms']:.1f}/"
              f"{r['quiet']['itl_p99_ms']:.1f}/{r['quiet']['itl_p999_ms']:.1f} ms | with long "
              f"prompts p50/p99/p99.9/max {r['long']['itl_p50_ms']:.1f}/"
              f"{r['long']['itl_p99_ms']:.1f}/{r['long']['itl_p999_ms']:.1f}/"
              f"{r['long']['itl_max_ms']:.1f} ms, stalls {r['long']['stall_s']:.2f} s, "
              f"chat {r['long']['chat_tokens_per_s']:.0f} tok/s, long TTFT median "
              f"{statistics.median(r['long']['long_ttft_s'] or [0]):.2f} s", flush=True)
    out = {"benchmark": "pd_interference", "command": command_line(),
           "machine": machine_info(), "note": ns.note, "args": vars(ns), "results": results}
    text = json.dumps(out, indent=1)
    if ns.out:
        Path(ns.out).write_text(text)
    return 0


def _pd_info(router_url: str) -> dict[str, Any]:
    """The decode worker's transfer counters (the router names it in x-banyan-worker)."""
    r = httpx.post(f"{router_url}/v1/completions", json={"prompt": [100, 101], "max_tokens": 1})
    decode = r.headers.get("x-banyan-worker", "")
    info = httpx.get(f"{decode}/server_info").json() if decode else {}
    return info.get("disaggregation") or {}


if __name__ == "__main__":
    raise SystemExit(main())
