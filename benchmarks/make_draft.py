"""Build a draft model for speculative decoding from the target itself: a copy keeping only some
of its decoder layers (same tokenizer, embeddings, final norm and head), a "self-speculative"
draft in the manner of LayerSkip / Draft & Verify, without training.

    python benchmarks/make_draft.py TARGET_DIR OUT_DIR --keep 0-7,29

SmolLM2-135M is the smallest model of its family, so no smaller same-tokenizer draft ships; a
layer-truncated copy is the best draft this machine can make offline. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file


def parse_layers(spec: str) -> list[int]:
    layers: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        layers.extend(range(int(lo), int(hi or lo) + 1))
    return sorted(set(layers))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("target", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--keep", default="0-7,29", help="layers to keep, e.g. 0-7,29")
    ns = parser.parse_args()
    keep = parse_layers(ns.keep)
    renumber = {old: new for new, old in enumerate(keep)}
    ns.out.mkdir(parents=True, exist_ok=True)
    state = {}
    for file in sorted(ns.target.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            parts = name.split(".")
            if parts[:2] == ["model", "layers"]:
                old = int(parts[2])
                if old not in renumber:
                    continue
                parts[2] = str(renumber[old])
            state[".".join(parts)] = tensor.contiguous()
    save_file(state, ns.out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((ns.target / "config.json").read_text())
    config["num_hidden_layers"] = len(keep)
    (ns.out / "config.json").write_text(json.dumps(config, indent=2))
    for extra in ns.target.iterdir():
        if extra.suffix != ".safetensors" and extra.name != "config.json" and extra.is_file():
            shutil.copy(extra, ns.out / extra.name)
    print(f"draft with layers {keep} of {ns.target} -> {ns.out}")


if __name__ == "__main__":
    main()
