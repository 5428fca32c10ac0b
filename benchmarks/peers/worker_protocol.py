"""The line protocol between run_side_by_side.py and its engine workers (standard library
only: the vLLM worker runs in vLLM's own virtual environment).

A worker loads its engine once, warms it up, then answers one JSON line per command on its
original stdout; everything else the libraries print goes to stderr (the worker's log).

    -> {"op": "run", "name": "random", "prompts": [[ids...], ...], "output_lens": [...]}
    <- {"ok": true, "result": {"elapsed_s": ..., "output_tokens": ..., ...}}
    -> {"op": "profile", "prompts": ..., "output_lens": ...}   (workers that can profile)
    <- {"ok": true, "result": {"top_ops": [...], ...}}
    -> {"op": "quit"}

The first line a worker writes is {"ok": true, "ready": {...}} (or {"ok": false, "error"}).
Every run starts with an empty prefix cache (the worker flushes it), so repeated runs of the
same prompts measure the same thing.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, TextIO

RunFn = Callable[[list[list[int]], list[int]], dict[str, Any]]


def take_stdout() -> TextIO:
    """The protocol channel: a private copy of stdout; fd 1 then points at stderr, so stray
    prints from libraries cannot corrupt the protocol."""
    sys.stdout.flush()
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return channel


def serve_forever(channel: TextIO, ready: dict[str, Any], run: RunFn,
                  profile: RunFn | None = None) -> None:
    channel.write(json.dumps({"ok": True, "ready": ready}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        if msg.get("op") == "quit":
            break
        if msg.get("op") == "profile":
            try:
                if profile is None:
                    raise NotImplementedError("this worker cannot profile")
                reply = {"ok": True, "result": profile(msg["prompts"], msg["output_lens"])}
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            channel.write(json.dumps(reply) + "\n")
            continue
        try:
            t0 = time.perf_counter()
            result = run(msg["prompts"], msg["output_lens"])
            result.setdefault("elapsed_s", time.perf_counter() - t0)
            n_out = result.get("output_tokens", 0)
            n_in = sum(len(p) for p in msg["prompts"])
            result.update(prompt_tokens=n_in, requests=len(msg["prompts"]),
                          output_tok_s=n_out / result["elapsed_s"],
                          total_tok_s=(n_in + n_out) / result["elapsed_s"])
            reply = {"ok": True, "result": result}
        except Exception as exc:  # noqa: BLE001 - report and keep serving
            traceback.print_exc()
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        channel.write(json.dumps(reply) + "\n")


def start(load: Callable[[], tuple[Any, ...]]) -> None:
    """Load the engine (timed), then serve commands; a failed load is reported, not hidden.
    `load` returns (ready info, run) or (ready info, run, profile)."""
    channel = take_stdout()
    t0 = time.perf_counter()
    try:
        ready, run, *rest = load()
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        channel.write(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}) + "\n")
        sys.exit(1)
    ready["startup_s"] = time.perf_counter() - t0
    serve_forever(channel, ready, run, rest[0] if rest else None)


def warmup_prompts(vocab: int, n: int = 4, length: int = 32) -> list[list[int]]:
    """A few prompts unlike any benchmark prompt (first-call costs stay out of the timing)."""
    return [[3 + (i * 7919 + k * 104729) % (vocab - 3) for k in range(length)] for i in range(n)]
