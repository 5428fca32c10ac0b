"""Where #13, #16 and #17's "Done when" figures stand after a run_targets.sh run: one Markdown
table of every target with its figure (from that run's JSON under benchmarks/results, named
with its TAG), the bar, and met or short, under the CPU the JSON names. A step that did not
run shows as "not run"; nothing is read from other runs, so every ratio is one run's own.

    python benchmarks/targets_report.py TAG [--results benchmarks/results]

run_targets.sh writes it to targets-TAG.md at its end.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

Figure = Callable[[dict[str, Any]], float | None]
# (issue, target, file stem before the TAG, figure from that file, bar, True: at least the bar)
TARGETS: list[tuple[str, str, str, Figure, float, bool]] = []


def target(issue: str, name: str, stem: str, bar: float, at_least: bool = True
           ) -> Callable[[Figure], Figure]:
    def add(fn: Figure) -> Figure:
        TARGETS.append((issue, name, stem, fn, bar, at_least))
        return fn
    return add


# ---- #13: beside vLLM-CPU (run_side_by_side.py), the prefill roofline, a competing load -------

def _sbs(d: dict[str, Any], suite: str, engine: str, key: str) -> float:
    return float(d["summary"][suite][engine][key])


# (target, suite, figure, numerator's engine, denominator's engine, bar): speeds as Banyan's
# over the other's, times as the other's over Banyan's
for _name, _suite, _key, _num, _den, _bar in (
        ("random 64 x 128/128 vs vLLM-CPU (output tok/s)", "random", "output_tok_s", "banyan",
         "vllm", 1.3),
        ("shared-prefix 8 x 8 vs vLLM-CPU (time)", "shared-prefix", "elapsed_s", "vllm",
         "banyan", 1.5),
        ("batch-1 128/128 vs vLLM-CPU (output tok/s)", "batch1", "output_tok_s", "banyan",
         "vllm", 1.5),
        ("shared-prefix, prefix cache on / off (time)", "shared-prefix", "elapsed_s",
         "banyan-nocache", "banyan", 4.0)):
    target("#13", _name, "side-by-side", _bar)(
        lambda d, s=_suite, k=_key, a=_num, b=_den: _sbs(d, s, a, k) / _sbs(d, s, b, k))


# the same three beside vLLM-CPU run by run: the median of Banyan's speed over vLLM's in each
# repetition (a pair minutes apart, where the AMX VMs' speed drifts 2x within minutes)
for _name, _suite, _bar in (("random 64 vs vLLM-CPU, run by run", "random", 1.3),
                            ("shared-prefix 8 x 8 vs vLLM-CPU, run by run", "shared-prefix", 1.5),
                            ("batch-1 vs vLLM-CPU, run by run", "batch1", 1.5)):
    target("#13", _name, "side-by-side", _bar)(
        lambda d, s=_suite: _sbs(d, s, "vllm", "paired_ratio_median"))


@target("#13", "fresh 2,048-token prefill over its time at the bf16 peak", "prefill-roofline-dense",
        1.6, at_least=False)
def _roofline(d: dict[str, Any]) -> float:
    return float(d["prefill_over_peak_time"])


@target("#13", "batch-1 beside a 2-thread matmul loop / idle (default)", "contention", 0.4)
def _contention(d: dict[str, Any]) -> float:
    return float(d["summary"]["default"]["loaded_own_over_idle"])


# ---- #16: low precision beside bf16 and llama.cpp (lowprec_side_by_side.py), the KV cache -----

_ACTIVATION_MODES = ("q8act", "tiles")  # lowprec_side_by_side's names for --activation-quant


def _lowprec(d: dict[str, Any], config: str, key: str) -> float | None:
    """A Banyan configuration's figure by its weights ("none", "int8", "int4", with "-q8act"
    for 8-bit activations, "-tiles" for int8_tiles), whatever dtype the run computed in."""
    want, _, mode = config.partition("-")
    for name, r in d["results"].items():
        parts = name.removeprefix("banyan ").split("-")
        modes = [m for m in _ACTIVATION_MODES if m in parts]
        if name.startswith("banyan ") and parts[0] == want and \
                modes == ([mode] if mode else []) and key in r:
            return float(r[key])
    return None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


def _llamacpp(d: dict[str, Any], blocks: str, key: str) -> float | None:
    r = d["results"].get(f"llama.cpp {blocks}")
    return None if r is None or key not in r else float(r[key])


_BLOCKS = {"int8": "Q8_0", "int4": "Q4_0"}  # llama.cpp's file for each weight format
for _what, _key, _bars, _cpp_bar in (
        ("batch-1 decode", "decode_tok_s", {"int8": 1.6, "int4": 2.5, "int8-tiles": 1.6}, 1.2),
        ("random 64", "random_64_output_tok_s",
         {"int8": 1.0, "int4": 1.0, "int8-q8act": 1.0, "int4-q8act": 1.0, "int8-tiles": 1.0},
         2.0)):
    for _cfg, _bar in _bars.items():
        target("#16", f"{_what} {_cfg} vs bf16", "lowprec", _bar)(
            lambda d, c=_cfg, k=_key: _ratio(_lowprec(d, c, k), _lowprec(d, "none", k)))
        # the same round by round (the median of each round's ratio; engines run in turns)
        target("#16", f"{_what} {_cfg} vs bf16, round by round", "lowprec", _bar)(
            lambda d, c=_cfg, k=_key: _lowprec(d, c, f"{k}_over_none"))
    for _cfg, _blocks in _BLOCKS.items():
        target("#16", f"{_what} {_cfg} vs llama.cpp {_blocks}", "lowprec", _cpp_bar)(
            lambda d, c=_cfg, b=_blocks, k=_key: _ratio(_lowprec(d, c, k), _llamacpp(d, b, k)))


def _kv_row(d: dict[str, Any], section: str, field: str, name: str) -> dict[str, Any] | None:
    return next((r for r in d[section] if r[field] == name), None)


for _kv in ("int8", "fp8_e4m3", "fp8_e5m2", "fp8"):
    target("#16", f"KV {_kv}: decode attention time vs bf16 (64 x 256)", "kv-quant", 1.0,
           at_least=False)(
        lambda d, k=_kv: (lambda r: None if r is None else float(r["vs_bf16_time"]))(
            _kv_row(d, "decode_attention", "variant", f"{k} (bf16 q)")))
    target("#16", f"KV {_kv}: perplexity over bf16's pool, +%", "kv-quant", 0.5, at_least=False)(
        lambda d, k=_kv: (lambda r: None if r is None else 100 * float(r["vs_auto"]))(
            _kv_row(d, "perplexity", "kv_cache_dtype", k)))


def _capacity(d: dict[str, Any], kv: str) -> float | None:
    rows = {r["kv_cache_dtype"]: r["bytes_per_token"] for r in d["capacity"]
            if r["dtype"] == "bfloat16"}
    return _ratio(rows.get("auto"), rows.get(kv))


# int8 (fp8_e4m3 / e5m2 alike): a scale per row; fp8: one unit scale for the pool
for _kv in ("int8", "fp8"):
    target("#16", f"KV {_kv}: tokens for the same memory vs bf16", "kv-quant", 2.0)(
        lambda d, k=_kv: _capacity(d, k))


# ---- #17: speculation (spec_side_by_side.py) ----------------------------------------------------

for _work, _cfg, _bar, _what in (("grounded", "ngram", 2.0, "batch 1, input-grounded, ngram"),
                                 ("chat", "ngram", 1.0, "batch 1, free chat, ngram"),
                                 ("chat", "draft", 1.5, "batch 1, chat, draft model"),
                                 ("load", "ngram", 0.95, "random 64 (under load), ngram"),
                                 ("load", "draft", 0.95, "random 64 (under load), draft")):
    target("#17", f"vs speculation off: {_what}", "spec-side-by-side", _bar)(
        lambda d, w=_work, c=_cfg: (lambda r: None if r is None else
                                    float(r["ratio_to_none_median"]))(
            d["summary"].get(w, {}).get(c)))


def report(tag: str, results: Path) -> str:
    cpu = None
    rows = ["| issue | target | figure | bar | |", "|---|---|---:|---:|---|"]
    outcomes: dict[str, list[tuple[str, bool]]] = {}  # issue -> (target, met) of those run
    for issue, name, stem, fn, bar, at_least in TARGETS:
        path = results / f"{stem}-{tag}.json"
        figure = None
        if path.exists():
            data = json.loads(path.read_text())
            cpu = cpu or data.get("machine")
            try:
                figure = fn(data)
            except (KeyError, TypeError, ZeroDivisionError):
                figure = None
        sign = ">=" if at_least else "<="
        if figure is None:
            status, shown = ("not run" if not path.exists() else "not in the run"), ""
        else:
            met = figure >= bar if at_least else figure <= bar
            status, shown = ("met" if met else "**short**"), shown_figure(figure, bar)
            outcomes.setdefault(issue, []).append((name, met))
        rows.append(f"| {issue} | {name} | {shown} | {sign} {bar:g} | {status} |")
    head = f"Targets of run `{tag}`"
    if cpu:
        head += (f" on {cpu.get('cpu')} (family/model {cpu.get('cpu_family_model')}; "
                 f"{', '.join(cpu.get('isa', []))}; {cpu.get('cores')} cores)")
    counts = []
    for issue, run in outcomes.items():
        short = [name for name, met in run if not met]
        counts.append(f"{issue}: {len(run) - len(short)} met, {len(short)} short"
                      + (f" ({'; '.join(short)})" if short else ""))
    return head + "\n\n" + "\n".join(f"- {c}" for c in counts) + "\n\n" + "\n".join(rows)


def shown_figure(figure: float, bar: float) -> str:
    """Two decimals, or three where two would print the bar itself (1.00 short of <= 1 is
    1.004): the table never shows a figure equal to its bar on the wrong side of it."""
    two = f"{figure:.2f}"
    return f"{figure:.3f}" if float(two) == bar and figure != bar else two


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tag")
    ap.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    ns = ap.parse_args()
    print(report(ns.tag, ns.results))


if __name__ == "__main__":
    main()
