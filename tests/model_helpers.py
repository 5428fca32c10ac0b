"""Helpers shared by the model tests: HF logits, a runner, and a tiny driver of ForwardBatches."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from banyan.batch import ForwardBatch, RowPrefix
from banyan.mem.allocator import SlotAllocator
from banyan.runner.model_runner import ModelRunner
from tests.hf_reference import hf_model

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
VOCAB = 512  # the shared tokenizer's size, so every model's vocabulary


def close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-4) -> bool:
    return bool((a - b).abs().max() <= rel * b.abs().max() + 1e-5)


def assert_close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-4, what: str = "") -> None:
    assert a.shape == b.shape, (what, a.shape, b.shape)
    err = (a - b).abs().max().item()
    assert close(a, b, rel), f"{what}: max|diff|={err:.3g} vs max|ref|={b.abs().max().item():.3g}"


def hf_logits(path: Path, ids: list[int]) -> torch.Tensor:
    """HF float32 logits [len(ids), vocab] of the model in `path` (models cached by folder)."""
    with torch.inference_mode():
        return hf_model(str(path))(torch.tensor([ids])).logits[0].float()


def make_runner(path: Path, **kw: object) -> ModelRunner:
    args: dict[str, object] = dict(num_slots=1024, max_rows=8, max_context=256, show_progress=False)
    args.update(kw)
    return ModelRunner(path, **args)  # type: ignore[arg-type]


def random_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


@dataclass
class Seq:
    """A request as the test drives it: its row, all its tokens, the KV slots computed so far."""

    row: int
    tokens: list[int]
    slots: list[int] = field(default_factory=list)


def build_batch(alloc: SlotAllocator, work: list[tuple[Seq, int]],
                prefixes: list[RowPrefix] | None = None) -> ForwardBatch:
    """The step computing `n` new tokens of each Seq, their KV slots allocated (and added to
    the Seqs); nothing sampled."""
    batch = ForwardBatch(row_prefixes=list(prefixes or []))
    for seq, n in work:
        p = len(seq.slots)
        new = alloc.alloc(n)
        assert new is not None
        batch.rows.append(seq.row)
        batch.prefix_lens.append(p)
        batch.extend_lens.append(n)
        batch.input_ids.extend(seq.tokens[p : p + n])
        batch.out_slots.extend(new)
        seq.slots.extend(new)
    return batch


def run_step(
    runner: ModelRunner,
    alloc: SlotAllocator,
    work: list[tuple[Seq, int]],
    prefixes: list[RowPrefix] | None = None,
) -> list[torch.Tensor]:
    """One step computing `n` new tokens of each Seq -> logits [n, vocab] at every new position.

    Also checks `runner.forward`'s sampled logits (last token of requests that reached their end)
    against those rows: forward rewrites the same K/V to the same slots, so running both is safe.
    """
    batch = build_batch(alloc, work, prefixes)
    batch.sample_indices = [
        i for i, (seq, _) in enumerate(work) if len(seq.slots) == len(seq.tokens)
    ]
    split, runner.split_mixed_steps = runner.split_mixed_steps, False  # one forward of all
    try:
        with torch.inference_mode():
            inputs = runner.prepare(batch)
            hidden = runner.model(inputs.input_ids, inputs.positions, inputs.attn_meta)
            every = runner.model.compute_logits(hidden)  # [T, vocab]
    finally:
        runner.split_mixed_steps = split
    per_req = list(every.split(batch.extend_lens))
    sampled = runner.forward(batch)
    assert sampled.shape == (len(batch.sample_indices), runner.vocab_size)
    for j, i in enumerate(batch.sample_indices):
        assert_close(sampled[j], per_req[i][-1], what="forward() sampled logits")
    return per_req
