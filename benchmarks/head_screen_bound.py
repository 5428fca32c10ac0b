"""How many vocabulary rows a provable screen of the LM head would leave to recompute exactly.

A greedy step needs the argmax of the head's logits, not the logits. A low-precision copy of
the head gives approximate logits a_j = x . w'_j; Cauchy-Schwarz bounds each one's error by
|x . (w_j - w'_j)| <= ||x|| ||w_j - w'_j|| = b_j (the residual norms precomputed once), so every
row with a_j + b_j below the largest a_k - b_k is provably not the argmax and only the others
(the candidates) need their exact logits: the same argmax from a fraction of the head's bytes.
Whether that pays depends on how few the candidates are. This captures the head's inputs over
greedy chat answers (the real SmolLM2-135M-Instruct, bf16, the `chat` prompts of `banyan bench`)
and counts the candidates per position for a few formats of the copy (float64 arithmetic: the
bound itself, not a kernel; a kernel adds its float32 accumulation's error to b_j).

    python benchmarks/head_screen_bound.py [--chats 8] [--tokens 64] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from banyan import Engine, SamplingParams
from banyan.bench.grounded import chat_workload
from banyan.bench.offline import command_line, machine_info
from banyan.model_files import resolve_model_dir

FORMATS = ((4, 32), (8, 32), (8, 0))  # (bits, group along the input; 0: one scale a row)


def quantized(w: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """w [V, K] rounded to symmetric `bits`-bit codes times a scale per group (absmax)."""
    v, k = w.shape
    g = w.view(v, k // (group or k), group or k)
    top = 2 ** (bits - 1) - 1
    scale = g.abs().amax(-1, keepdim=True) / top
    scale[scale == 0] = 1.0
    return (torch.round(g / scale).clamp(-top - 1, top) * scale).view(v, k)


def head_inputs(chats: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the head's input rows of every sampled position, the head's weight), float64."""
    model_dir = str(resolve_model_dir(None))
    engine = Engine(model_dir, dtype="bfloat16", device="cpu", disable_tqdm=True,
                    kv_cache_memory="512MiB")
    model = engine.core.scheduler.runner.model_runner.model
    rows: list[torch.Tensor] = []
    plain = model.compute_logits

    def capture(hidden: torch.Tensor) -> torch.Tensor:
        rows.append(hidden.detach().clone())
        return plain(hidden)

    model.compute_logits = capture
    from transformers import AutoTokenizer

    workload = chat_workload(AutoTokenizer.from_pretrained(model_dir), chats, tokens)
    params = SamplingParams(max_new_tokens=tokens, temperature=0.0)
    for req in workload.requests:
        engine.generate(input_ids=[req.prompt_ids], sampling_params=params)
    weight = model.lm_head.weight if model.lm_head is not None else model.embed_tokens.weight
    return torch.cat(rows).double(), weight.double()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chats", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    x, w = head_inputs(ns.chats, ns.tokens)
    exact = x @ w.T
    norms = x.norm(dim=1, keepdim=True)
    results = []
    for bits, group in FORMATS:
        wq = quantized(w, bits, group)
        approx = x @ wq.T
        bound = norms * (w - wq).norm(dim=1)[None, :]
        floor = (approx - bound).max(dim=1, keepdim=True).values
        cand = ((approx + bound) >= floor).sum(dim=1).double()
        row_group = group or w.shape[1]
        row = {"bits": bits, "group": row_group, "positions": x.shape[0],
               "candidates_median": cand.median().item(),
               "candidates_p90": cand.quantile(0.9).item(), "candidates_max": cand.max().item(),
               "bound_median": bound.median().item(),
               "largest_actual_error": (exact - approx).abs().max().item(),
               # the codes and a float16 scale a group
               "copy_bytes_per_row": w.shape[1] * bits // 8 + 2 * (w.shape[1] // row_group)}
        results.append(row)
        print(f"int{bits} group {row['group']}: candidates median {row['candidates_median']:.0f}"
              f", p90 {row['candidates_p90']:.0f}, max {row['candidates_max']:.0f} of "
              f"{w.shape[0]}; bound median {row['bound_median']:.3f}, largest actual error "
              f"{row['largest_actual_error']:.3f}")
    if ns.out:
        Path(ns.out).write_text(json.dumps({
            "command": command_line(), "machine": machine_info(), "vocab": w.shape[0],
            "hidden": w.shape[1], "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
