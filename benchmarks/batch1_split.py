"""Where a batch-1 decode step goes, per weight format side by side: the layer stack's ops
(`NativeLayerStack.time_ops`: norms, projections, RoPE, K/V stores, attention, SiLU), the LM
head, and the rest of the step (embedding, sampling, scheduling, Python), with each
projection's read rate (its weights' bytes over its time, 30 layers a step). #16 asks int4 at
2.5x bf16's batch-1 speed: with weights a quarter of bf16's bytes, what does not shrink with
them (attention, small ops, the host, each call's start) sets how close it gets.

The configurations alternate round by round in one process (this VM's bandwidth drifts between
rounds); each round runs one untimed 128/128 request (the tok/s) and one timed the same way
(the split; its clock reads cost ~1%).

    python benchmarks/batch1_split.py [--configs none,int8,int4] [--rounds 5] [--out FILE]
        [--input-len 128] [--output-len 128]

--input-len / --output-len: the request's lengths (attention's share of a step grows with the
keys it reads: 128/128 decodes over 129-256).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from banyan import Engine
from banyan.bench.offline import batch1, command_line, machine_info, memory_bandwidth_gbs
from banyan.bench.report import write_json
from banyan.model_files import resolve_model_dir

IN_LEN = OUT_LEN = 128
PROJECTIONS = {"qkv": "self_attn.qkv_proj", "o": "self_attn.o_proj",
               "gate_up": "mlp.gate_up_proj", "down": "mlp.down_proj"}


def projection_bytes(engine: Engine) -> dict[str, int]:
    """Bytes each kind of projection reads a step (all layers), and the LM head's."""
    model = engine.core.scheduler.runner.model_runner.model
    out = {kind: sum(layer.get_submodule(path).weight_bytes() for layer in model.layers)
           for kind, path in PROJECTIONS.items()}
    head = model.lm_head if model.lm_head is not None else model.tied_head
    out["lm_head"] = (head.weight_bytes() if head is not None
                      else model.embed_tokens.weight.numel()
                      * model.embed_tokens.weight.element_size())
    return out


def timed_split(engine: Engine, vocab: int, input_len: int = IN_LEN,
                output_len: int = OUT_LEN) -> dict[str, float]:
    """One request's decode steps (its prefill left out) with the stack's ops and the LM head
    timed: ms a step each, "rest" what the step spent outside both."""
    runner = engine.core.scheduler.runner.model_runner
    model, stack = runner.model, runner.stack
    assert stack is not None, "batch-1 steps off the native layer stack: nothing to split"
    head_s = [0.0]
    plain = model.compute_logits

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        out = plain(hidden)
        head_s[0] += time.perf_counter() - t0
        return out

    def start_clocks() -> None:  # the prefill's token is out: the decode steps from here
        stack.time_ops(True)
        head_s[0] = 0.0

    model.compute_logits = compute_logits
    try:
        one = batch1(engine, input_len, output_len, vocab, on_first_token=start_clocks)
        ops = stack.op_seconds()
    finally:
        stack.time_ops(False)
        del model.compute_logits  # the class's own again
    steps = one["output_tokens"] - 1
    step_ms = 1e3 / one["decode_tok_s"]
    split = {op: s / steps * 1e3 for op, s in ops.items()}
    # greedy steps run the head inside the native call (the stack's "head" op), others in torch
    split["lm_head"] = head_s[0] / steps * 1e3 + split.pop("head", 0.0)
    split["rest"] = step_ms - sum(split.values())
    split["step"] = step_ms
    return split


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="none,int8,int4")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--input-len", type=int, default=IN_LEN)
    ap.add_argument("--output-len", type=int, default=OUT_LEN)
    ns = ap.parse_args()
    lengths = ns.input_len, ns.output_len
    configs = ns.configs.split(",")
    engines = {q: Engine(str(resolve_model_dir(None)), dtype=ns.dtype, device="cpu",
                         quantization=q, disable_tqdm=True, kv_cache_memory="512MiB")
               for q in configs}
    vocab = next(iter(engines.values())).core.vocab_size
    for engine in engines.values():
        batch1(engine, 16, 8, vocab)  # warm: first-call allocations and kernel builds
        engine.core.populate_kv()
    rounds: dict[str, list[dict[str, float]]] = {q: [] for q in configs}
    for r in range(ns.rounds):
        order = configs if r % 2 == 0 else configs[::-1]
        for q in order:
            split = timed_split(engines[q], vocab, *lengths)
            split["decode_tok_s"] = batch1(engines[q], *lengths, vocab)["decode_tok_s"]
            rounds[q].append(split)
    results: dict[str, Any] = {}
    for q, runs in rounds.items():
        med = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
        nbytes = projection_bytes(engines[q])
        results[q] = {
            "median_ms_a_step": {k: round(v, 4) for k, v in med.items() if k != "decode_tok_s"},
            "decode_tok_s": round(med["decode_tok_s"], 1),
            "decode_tok_s_by_round": [round(run["decode_tok_s"], 1) for run in runs],
            "gb_s_by_projection": {k: round(b / (med[k] * 1e-3) / 1e9, 1)
                                   for k, b in nbytes.items()},
            "bytes_by_projection": nbytes,
            "rounds": runs}
    base = rounds[configs[0]]
    out = {"command": command_line(), "machine": machine_info(),
           "copy_bandwidth_gb_s": memory_bandwidth_gbs(), "input_len": ns.input_len,
           "output_len": ns.output_len, "results": results,
           "ratio_to_first_by_round": {
               q: [round(run["decode_tok_s"] / b["decode_tok_s"], 3)
                   for run, b in zip(rounds[q], base, strict=True)] for q in configs[1:]}}
    write_json(out, ns.out, echo=False)
    for q in configs:
        res = results[q]
        print(f"{q:6s} {res['decode_tok_s']:7.1f} tok/s  ms a step:",
              {k: round(v, 3) for k, v in res["median_ms_a_step"].items()})
        print("        GB/s:", res["gb_s_by_projection"])
    print("ratios to", configs[0], "by round:", out["ratio_to_first_by_round"])


if __name__ == "__main__":
    main()
