"""Print the speculative-decoding runs (benchmarks/run_spec_benchmarks.sh) as a Markdown table:
output tokens/s, the ratio to the same workload and dtype without speculation, acceptance.

    python benchmarks/spec_report.py [FOLDER] [PREFIX]   (PREFIX default "spec-": files
    PREFIX<workload>-<algo>-<dtype>.json; e.g. "spec-zen3-" for another machine's set)"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results")
    prefix = sys.argv[2] if len(sys.argv) > 2 else "spec-"
    runs = {p.stem.removeprefix(prefix): json.loads(p.read_text())
            for p in sorted(folder.glob(f"{prefix}*.json"))
            if p.stem.removeprefix(prefix).count("-") == 2 and "step-cost" not in p.stem}
    # spec-<workload>-<algo>-<dtype>; the step-cost files are another benchmark's
    print("| run | output tok/s | vs none | acceptance length | accepted / guessed "
          "| per position |")
    print("|---|---|---|---|---|---|")
    for name, data in runs.items():
        workload, algo, dtype = name.split("-")
        r = data["result"]
        base = runs.get(f"{workload}-none-{dtype}")
        ratio = r["output_tok_s"] / base["result"]["output_tok_s"] if base else float("nan")
        s = r.get("speculative") or {}
        accept = f"{s['mean_acceptance_length']:.2f}" if s.get("num_drafts") else ""
        guessed = f"{s['num_accepted_tokens']} / {s['num_draft_tokens']}" if s else ""
        per_pos = " ".join(f"{x:.2f}" for x in s.get("per_position_rate", []))
        print(f"| {name} | {r['output_tok_s']:.2f} | {ratio:.2f}x | {accept} | {guessed} "
              f"| {per_pos} |")
    cpu = next(iter(runs.values()))["machine"] if runs else {}
    print(f"\nMachine: {cpu}")


if __name__ == "__main__":
    main()
