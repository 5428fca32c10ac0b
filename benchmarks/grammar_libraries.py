"""Compares xgrammar and llguidance on this machine: JSON-schema compile time and the per-step
token-bitmask fill at batch 1 and 64, for a small test tokenizer and SmolLM2's 49152 vocabulary.

    python benchmarks/grammar_libraries.py --tokenizer DIR [--tokenizer DIR2] --out results.json

Needs llguidance (pip install llguidance==1.9.1), which Banyan does not depend on.
The two libraries run interleaved (each measurement alternates between them), so a shared,
noisy machine affects both alike. The decision it informed is recorded in docs/structured_output.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from banyan.bench.offline import machine_info

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]},
                 "maxItems": 3},
        "score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["city", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["id", "ok"], "additionalProperties": False}}},
     "required": ["items"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                                      "when": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}$"}},
     "required": ["kind", "when"], "additionalProperties": False},
]


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.vocab = vocab

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matchers(self, compiled: Any, n: int, prefix: list[int]) -> list[Any]:
        out = [self.xgr.GrammarMatcher(compiled) for _ in range(n)]
        for m in out:
            for token in prefix:
                assert m.accept_token(token)
        return out

    def bitmask(self, n: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(n, self.vocab)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll, self.llt = llguidance, llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        self.compact_prefix = tokenizer.encode('{"name":"', add_special_tokens=False)
        self.vocab = vocab

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
        m = self.ll.LLMatcher(self.tok, grammar)  # llguidance compiles lazily: force a mask
        bm = self.llt.allocate_token_bitmask(1, self.vocab)
        self.llt.fill_next_token_bitmask(m, bm, 0)
        return grammar

    def matchers(self, compiled: Any, n: int, prefix: list[int]) -> list[Any]:
        out = [self.ll.LLMatcher(self.tok, compiled) for _ in range(n)]
        for m in out:  # llguidance writes compact JSON: no space after the colon
            assert m.consume_tokens(self.compact_prefix), m.get_error()
        return out

    def bitmask(self, n: int) -> torch.Tensor:
        return self.llt.allocate_token_bitmask(n, self.vocab)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        for i, m in enumerate(matchers):
            self.llt.fill_next_token_bitmask(m, bitmask, i)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.llt.apply_token_bitmask_inplace(logits, bitmask)


def measure(libs: list[Any], batch: int, steps: int,
            prefix: list[int]) -> dict[str, dict[str, float]]:
    """Per library: ms to fill a [batch, V] mask from matchers inside a JSON string (`{"name":
    "` accepted: nearly the whole vocabulary is allowed, the costliest kind of mask), and ms
    to apply it to float32 logits with the library's own kernel."""
    out: dict[str, dict[str, list[float]]] = {lib.name: {"fill": [], "apply": []} for lib in libs}
    prepared = []
    for lib in libs:
        compiled = lib.compile(SCHEMAS[0])
        prepared.append((lib, lib.matchers(compiled, batch, prefix), lib.bitmask(batch),
                         torch.randn(batch, lib.vocab)))
    for _ in range(steps):
        for lib, matchers, bitmask, logits in prepared:  # interleaved
            t0 = time.perf_counter()
            lib.fill(matchers, bitmask)
            t1 = time.perf_counter()
            lib.apply(logits, bitmask)
            t2 = time.perf_counter()
            out[lib.name]["fill"].append((t1 - t0) * 1e3)
            out[lib.name]["apply"].append((t2 - t1) * 1e3)
    return {name: {k: round(statistics.median(v), 4) for k, v in d.items()}
            for name, d in out.items()}


def main() -> None:
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", action="append", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--note", default="", help="how busy the machine was, for the record")
    args = ap.parse_args()
    report: dict[str, Any] = {"cpu": machine_info()["cpu"], "machine": args.note,
                              "command": "python benchmarks/grammar_libraries.py " + " ".join(
                                  f"--tokenizer {Path(t).name}" for t in args.tokenizer),
                              "tokenizers": {}}
    for tdir in args.tokenizer:
        tok = AutoTokenizer.from_pretrained(tdir)
        vocab = len(tok)
        libs = []
        init: dict[str, float] = {}
        for cls in (Xgrammar, Llguidance):
            t0 = time.perf_counter()
            libs.append(cls(tok, vocab))
            init[cls.name] = round((time.perf_counter() - t0) * 1e3, 1)
        prefix = tok.encode('{"name": "', add_special_tokens=False)
        compile_ms: dict[str, list[float]] = {lib.name: [] for lib in libs}
        for schema in SCHEMAS:
            for lib in libs:
                t0 = time.perf_counter()
                lib.compile(schema)
                compile_ms[lib.name].append(round((time.perf_counter() - t0) * 1e3, 2))
        report["tokenizers"][f"vocab {vocab}"] = {
            "tokenizer_init_ms": init,
            "compile_ms_per_schema": compile_ms,
            "batch_1_ms": measure(libs, 1, args.steps, prefix),
            "batch_64_ms": measure(libs, 64, max(5, args.steps // 3), prefix),
        }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
