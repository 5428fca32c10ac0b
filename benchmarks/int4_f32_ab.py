"""Two builds of the int4 float32 kernel (`banyan_int4_linear_f32`), alternated call by call in
one process on SmolLM2-135M's MLP shapes, asserting equal bits; medians of each.

    python benchmarks/int4_f32_ab.py A.so B.so [--tokens 10,24,64,512] [--rounds 9] \
        [--copies N] [--out F]

A and B are kernel libraries of two checkouts (~/.cache/banyan/kernels/*.so, built by
`banyan.kernels.native.load()` in each). --copies N: N layers of each shape called in turn, so
that (N large enough) their weights come from memory as in a decode step, not from the cache.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from two_builds import native_libraries, parse_args  # noqa: E402

from banyan.bench.offline import cpu_label, machine_info  # noqa: E402
from banyan.kernels import native  # noqa: E402
from banyan.layers.linear import Linear  # noqa: E402
from banyan.layers.quant import Int4Method  # noqa: E402

SHAPES = ((1536, 576), (576, 1536))  # (out, in): gate/up, down


def main() -> None:
    ns = parse_args(__doc__, "10,24,64,512", 9,
                    lambda ap: ap.add_argument("--copies", type=int, default=1))
    libs = native_libraries(ns.a, ns.b)
    torch.manual_seed(0)
    rows = []
    for out_f, in_f in SHAPES:
        method = Int4Method(group=32)  # (its kernel call reads the layer's own buffers)
        layers = []
        for _ in range(ns.copies):
            layer = Linear(in_f, out_f, bias=False)
            layer.weight.data = torch.randn(out_f, in_f) * 0.05
            method.adopt(layer)
            layers.append(layer)
        for tokens in ns.tokens:
            x = torch.randn(tokens, in_f)
            outs = {name: torch.empty(len(layers), tokens, out_f) for name in libs}
            times: dict[str, list[float]] = {name: [] for name in libs}
            reps = max(3, 400 // tokens)
            calls = -(-reps // len(layers)) * len(layers)
            for _ in range(ns.rounds):
                for name, lib in libs.items():
                    native.load = lambda lib=lib: lib  # type: ignore[assignment]
                    method._kernel(layers[0], x, outs[name][0])
                    start = time.perf_counter()
                    for c in range(calls):
                        i = c % len(layers)
                        method._kernel(layers[i], x, outs[name][i])
                    times[name].append((time.perf_counter() - start) / calls)
            assert torch.equal(outs["a"], outs["b"]), "the builds' bits differ"
            a, b = (statistics.median(times[name]) for name in ("a", "b"))
            flop = 2 * out_f * in_f * tokens
            rows.append({"out": out_f, "in": in_f, "tokens": tokens, "copies": ns.copies,
                         "a_ms": a * 1e3, "b_ms": b * 1e3, "b_over_a_time": b / a,
                         "a_gflops": flop / a / 1e9, "b_gflops": flop / b / 1e9})
            print(json.dumps(rows[-1]), flush=True)
    home = str(Path.home())
    report = {"command": ns.command,
              "cpu": cpu_label(machine_info()), "threads": torch.get_num_threads(),
              "rows": rows}
    if ns.out is not None:
        ns.out.write_text(json.dumps(report, indent=1).replace(home, "~") + "\n")


if __name__ == "__main__":
    main()
