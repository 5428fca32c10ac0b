"""What each phase of the AVX-512 decode-attention loop (cpu_attend512.h) costs, by taking it
out: the kernel sources are copied, one phase is disabled in each copy (its outputs are then
wrong: this times, it does not check), each copy is built, and the builds are timed call by
call in one process on the decode steps of benchmarks/decode_attention.py (SmolLM2-135M's
heads, 30 layers, bf16):

- shared-prefix 8 x 8 over 1,024 + 100 keys, and random 64 x 192 keys,
- each cold (30 layers of K/V, ~336 / ~283 MB a step, from memory) and hot (every layer's call
  on layer 0's K/V, which then stays in the last-level cache: the kernel's own work).

A phase's cost is the base build's time minus the time without it. The phases: the scores
(block_scores: key transposes and dot products), the key transposes alone, the softmax, the
values' pair interleaving, their products (add_pairs_rows), the software prefetches, and
stream_in (each request's own K/V read in slot order first); over a quantized pool
(--kv-cache-dtype int8 / fp8_*) also the keys' codes made bf16 and the rows' scales read from
their table, and over a bf16 model's int8 pool on VNNI (cpu_attend512_i8.h) its own phases:
scores, softmax, probability codes, value interleave and products.

    python benchmarks/decode_attention_phases.py [--rounds 9] [--kv-cache-dtype int8]
        [--phases scores,softmax] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from banyan.bench.offline import command_line, machine_info
from banyan.kernels import native
from decode_attention import decode_step, workload_rows  # (this folder's)
from two_builds import typed_libraries

A512, ATT, I8 = "cpu_attend512.h", "cpu_attend.h", "cpu_attend512_i8.h"
# phase -> (file, text, the same text with the phase switched off by a condition never true)
PHASES: dict[str, tuple[str, str, str]] = {
    "scores": (A512, "            block_scores<T, kCodes>(sc, qraw,",
               "            if (d < 0) block_scores<T, kCodes>(sc, qraw,"),
    "key transposes": (
        A512, "                transpose16(r);\n                for (int i = 0; i < 16; ++i)",
        "                if (d < 0) transpose16(r);\n"
        "                for (int i = 0; i < 16 && d < 0; ++i)"),
    "softmax": (A512, "\n            chunk_softmax(sc, rr,",
                "\n            if (seen < 0) chunk_softmax(sc, rr,"),
    "int8 softmax": (A512, "                chunk_softmax(sc, rr, sr, seen, blocks, scale, d, "
                           "nullptr);",
                     "                if (d < 0) chunk_softmax(sc, rr, sr, seen, blocks, scale, d,"
                     " nullptr);"),
    "value interleave": (A512, "    for (int jp = 0; jp < (cn + 1) / 2; ++jp) {",
                         "    for (int jp = 0; jp < (cn + 1) / 2 && d < 0; ++jp) {"),
    "value products": (A512, "                for (int c0 = 0; c0 < words; c0 += 4)\n",
                       "                for (int c0 = 0; c0 < words && d < 0; c0 += 4)\n"),
    "prefetches": (ATT, "    for (int64_t j = j0; j < j1; ++j) {",
                   "    for (int64_t j = j0; j < j1 && d < 0; ++j) {"),
    # a quantized pool's own (--kv-cache-dtype int8 / fp8_*: no effect on a bf16 pool)
    "key codes to bf16": (
        A512, "                        for (int e = 0; e < d; e += 32)\n"
              "                            _mm512_storeu_si512(kc + e, bf16(",
        "                        for (int e = 0; e < d && d < 0; e += 32)\n"
        "                            _mm512_storeu_si512(kc + e, bf16("),
    "int8 scores": (A512, "                block_scores_i8(sc, first, rows,",
                    "                if (d < 0) block_scores_i8(sc, first, rows,"),
    "probability codes": (A512, "                probability_codes(sc, r, sr, blocks);",
                          "                if (d < 0) probability_codes(sc, r, sr, blocks);"),
    "int8 value interleave": (I8, "    for (int q = 0; q < (cn + 3) / 4; ++q) {",
                              "    for (int q = 0; q < (cn + 3) / 4 && d < 0; ++q) {"),
    "int8 value products": (I8, "        for (int q = 0; q < quads; q += S) {",
                            "        for (int q = 0; q < quads && d < 0; q += S) {"),
    "row scales read": (
        A512, "                    ks[j] = row_scale(kscale, row) * code_unit<Codes>;\n"
              "                    sc.vsc[j0 + j] = row_scale(vscale, row) * code_unit<Codes>;",
        "                    ks[j] = code_unit<Codes>;  // (no scale table read)\n"
        "                    sc.vsc[j0 + j] = code_unit<Codes>;"),
    "stream_in": (ATT, "    for (int64_t j = 0; j < n; ++j) {\n        const int64_t at = slots[j]",
                  "    for (int64_t j = 0; j < n && row_bytes < 0; ++j) {\n"
                  "        const int64_t at = slots[j]"),
}


def build(phase: str | None, work: Path) -> Path:
    """The kernels' library with `phase` switched off (None: as they are)."""
    src = work / (phase or "base").replace(" ", "_")
    shutil.copytree(Path(native.__file__).parent, src,
                    ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    if phase is not None:
        name, text, off = PHASES[phase]
        path = src / name
        code = path.read_text()
        if code.count(text) != 1:
            raise SystemExit(f"{phase}: its text is not once in {name} (the kernel changed: "
                             "update PHASES)")
        path.write_text(code.replace(text, off))
    return native._build(os.environ.get("CXX") or "g++", src)  # (native.load's compiler)


def steps(kv_cache_dtype: str) -> dict[str, Callable[[], None]]:
    """case -> one decode step's attention over all layers, cold and hot, over a pool stored
    as kv_cache_dtype."""
    random_rows, shared_rows = workload_rows()
    return {f"{name}, {temp}": decode_step(rows, torch.bfloat16, hot=temp == "hot",
                                           kv_cache_dtype=kv_cache_dtype)[0]
            for name, rows in (("shared-prefix 8 x 8", shared_rows),
                               ("random 64 x 192", random_rows))
            for temp in ("cold", "hot")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", default=None)
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="the pool's storage (auto: bf16; int8, fp8_e4m3, ...)")
    ap.add_argument("--phases", default=",".join(PHASES),
                    help="comma-separated phases to take out (default: all)")
    ns = ap.parse_args()
    variants: list[str | None] = [None, *ns.phases.split(",")]
    with tempfile.TemporaryDirectory() as work:
        libs = typed_libraries({v: build(v, Path(work)) for v in variants})
    cases = steps(ns.kv_cache_dtype)
    seconds = {c: {v: [] for v in variants} for c in cases}
    keep = native.load
    try:
        with torch.inference_mode():
            for r in range(ns.rounds):
                for case, run in cases.items():
                    for v in variants if r % 2 == 0 else variants[::-1]:
                        native.load = lambda lib=libs[v]: lib  # type: ignore[assignment]
                        run()  # (warms the caches this build's call will find)
                        t0 = time.perf_counter()
                        run()
                        seconds[case][v].append(time.perf_counter() - t0)
    finally:
        native.load = keep  # type: ignore[assignment]
    results = []
    for case in cases:
        base = statistics.median(seconds[case][None]) * 1e3
        row = {"case": case, "base_ms": round(base, 3), "phase_ms": {}}
        for phase in variants[1:]:
            row["phase_ms"][phase] = round(base - statistics.median(seconds[case][phase]) * 1e3,
                                           3)
        results.append(row)
        print(f"{case:28s} {base:6.2f} ms a step; without each phase, ms saved: "
              + ", ".join(f"{p} {ms:.2f}" for p, ms in row["phase_ms"].items()))
    if ns.out:
        Path(ns.out).write_text(json.dumps({
            "command": command_line(), "machine": machine_info(),
            "threads": torch.get_num_threads(), "rounds": ns.rounds,
            "kv_cache_dtype": ns.kv_cache_dtype, "results": results},
            indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
