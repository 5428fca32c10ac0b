"""Structured-output validity: 1,000 sampled generations across 20 JSON schemas on a
random-weight model, each parsed and validated with `jsonschema` (target: 100% valid).

    python benchmarks/structured_validity.py [--model DIR] [--per-schema 50] \
        [--out benchmarks/results/structured-validity.json]

Without --model it builds the tiny random llama of the tests (512-token BPE) in a temporary
folder. The schemas are in banyan/structured/validity.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from banyan.bench.offline import machine_info
from banyan.engine.offline import Engine
from banyan.structured.validity import SCHEMAS, run


def tiny_model(folder: Path) -> Path:
    from banyan.demo import build_random_model

    return build_random_model(folder, "llama", tokenizer_vocab=512,
                              tokenizer_corpus_bytes=400_000, hidden_size=64,
                              intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=1024,
                              initializer_range=0.1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--per-schema", type=int, default=50)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--overlap", default="on", choices=["on", "off"])
    ap.add_argument("--out", type=Path)
    ns = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(ns.model) if ns.model else tiny_model(Path(tmp))
        with Engine(str(model), dtype="float32", disable_tqdm=True, overlap=ns.overlap,
                    kv_cache_memory="512MiB") as engine:
            t0 = time.perf_counter()
            report = run(engine, ns.per_schema, ns.max_new_tokens)
            seconds = time.perf_counter() - t0
    result = {
        "benchmark": "structured-output validity",
        "command": "python " + " ".join(  # no machine paths in results: folder names
            Path(a).name if a.startswith("/") else a for a in sys.argv),
        "model": model.name if ns.model else "tiny random llama (tests' config, 512-token BPE)",
        "machine": machine_info(), "note": "machine shared with other engineers' jobs",
        "schemas": len(SCHEMAS), "generations": report.generations, "valid": report.valid,
        "valid_percent": round(report.valid_percent, 2),
        "finish_reasons": report.finish_reasons, "failures": report.failures,
        "seconds": round(seconds, 1),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if ns.out:
        ns.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
