"""A long prefix restored from the file KV tier vs computed again, side by side in one run.

Per rep, a fresh random prompt of --prompt-tokens tokens:
  compute   the prompt is computed (nothing cached), one output token: its TTFT;
  restore   the device prefix cache is flushed, the same prompt again: its KV is loaded from the
            tier (the block files are in the OS page cache, as they are right after writing);
  cold      as restore, after the files were dropped from the page cache (fsync + fadvise
            DONTNEED), so they are read from the disk.
Then a new engine on the same directory (a restart) restores the last prompt: `restart`.

    python benchmarks/hicache_restore.py [--model DIR] [--dtype bfloat16] [--prompt-tokens 4096]
        [--reps 3] [--note TEXT] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from banyan import Engine, SamplingParams
from banyan.bench.offline import command_line, machine_info


def drop_page_cache(directory: Path) -> None:
    for path in directory.rglob("*.kv"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def ttft(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first token, and prompt tokens loaded from the tier meanwhile."""
    kv = engine.core.scheduler.kv
    before = kv.tier_loaded
    t0 = time.perf_counter()
    engine.generate(input_ids=[prompt], use_tqdm=False,
                    sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0))
    return time.perf_counter() - t0, kv.tier_loaded - before


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the real SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--note", default="")
    ap.add_argument("--out", default=None)
    ns = ap.parse_args(argv)
    rows: dict[str, list[float]] = {"compute": [], "restore": [], "cold": [], "restart": []}
    loaded: dict[str, list[int]] = {k: [] for k in rows}
    with tempfile.TemporaryDirectory() as tmp:
        kw: dict[str, Any] = dict(dtype=ns.dtype, disable_tqdm=True, kv_cache_memory="1GiB",
                                  hicache_backend="file", hicache_dir=tmp)
        rng = random.Random(0)
        with Engine(ns.model, **kw) as engine:
            vocab = engine.core.vocab_size
            prompts = [[rng.randrange(100, vocab) for _ in range(ns.prompt_tokens)]
                       for _ in range(ns.reps)]
            ttft(engine, [rng.randrange(100, vocab) for _ in range(256)])  # warm-up
            tier = engine.core.scheduler.kv.tier
            for prompt in prompts:
                for mode in ("compute", "restore", "cold"):
                    if mode != "compute":
                        tier.flush()  # the write-through of the compute run is on disk
                        assert engine.flush_cache()
                    if mode == "cold":
                        drop_page_cache(Path(tmp))
                    seconds, n = ttft(engine, prompt)
                    rows[mode].append(seconds)
                    loaded[mode].append(n)
            counters = tier.counters()
        with Engine(ns.model, **kw) as engine:
            seconds, n = ttft(engine, prompts[-1])
            rows["restart"].append(seconds)
            loaded["restart"].append(n)
    med = {k: statistics.median(v) for k, v in rows.items()}
    result: dict[str, Any] = {
        "command": command_line(), "machine": machine_info(), "note": ns.note,
        "model": ns.model or "SmolLM2-135M-Instruct (real)", "dtype": ns.dtype,
        "prompt_tokens": ns.prompt_tokens, "reps": ns.reps, "ttft_s": rows,
        "loaded_tokens": loaded, "median_ttft_s": med,
        "speedup_restore": med["compute"] / med["restore"],
        "speedup_cold": med["compute"] / med["cold"],
        "speedup_restart": med["compute"] / med["restart"],
        "restore_gb_per_s": counters["loaded_bytes"] / counters["load_seconds"] / 1e9,
        "bytes_per_token": counters["loaded_bytes"] / max(counters["loaded_tokens"], 1),
        "tier": counters,
    }
    for mode in rows:
        print(f"{mode:8} TTFT {med[mode] * 1e3:9.1f} ms   loaded tokens {loaded[mode]}")
    print(f"restore {result['speedup_restore']:.1f}x, cold {result['speedup_cold']:.1f}x, "
          f"restart {result['speedup_restart']:.1f}x faster than computing; loads at "
          f"{result['restore_gb_per_s']:.2f} GB/s")
    if ns.out:
        Path(ns.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
