"""Print a Markdown table of the benchmark JSON files in a folder."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results")
    print("| run | elapsed s | output tok/s | total tok/s | cached tokens | hit rate vs optimum "
          "| retractions |")
    print("|---|---|---|---|---|---|---|")
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        if "result" not in data:  # bench serve and side-by-side files have their own tables
            continue
        r = data["result"]
        hit = r.get("hit_rate_vs_optimum")
        print(f"| {path.stem} | {r['elapsed_s']:.1f} | {r['output_tok_s']:.1f} "
              f"| {r['total_tok_s']:.0f} "
              f"| {r['cached_tokens']} | {'' if hit is None else f'{hit:.3f}'} "
              f"| {r.get('retractions', '')} |")
        if "batch1" in data:
            b = data["batch1"]
            print(f"| {path.stem} batch-1 | {b['elapsed_s']:.2f} | {b['output_tok_s']:.1f} "
                  f"(decode {b['decode_tok_s']:.1f}; bound {b['decode_bound_tok_s']:.0f} at "
                  f"{b['memory_bandwidth_gbs']:.0f} GB/s: {b['fraction_of_bound']:.0%}) | | | | |")


if __name__ == "__main__":
    main()
