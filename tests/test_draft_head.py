"""A draft's guesses from a 4-bit copy of its LM head (spec/draft_head.py): the native pick
against a float64 reference (candidates within the margin, capped, re-scored from the rows; the
lowest id on a tie; the probability over the copy's logits with the candidates' replaced), and
the head on a real bf16 runner against the plain logits' argmax and probability."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from banyan import Engine, SamplingParams
from banyan.batch import ForwardBatch
from banyan.kernels import native
from banyan.layers.linear import PackedBf16Method, PairsBf16Method
from banyan.runner.model_runner import ModelRunner
from banyan.sampling.greedy import top_token_and_probability
from banyan.spec import draft_head
from banyan.spec.draft_head import DraftHead
from tests.test_engine import check_pool_empty

pytestmark = pytest.mark.skipif(native.load() is None, reason="native kernels unavailable")


def reference_pick(approx: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, cap: int,
                   margin: float) -> tuple[list[int], list[float]]:
    tokens, probs = [], []
    for a, xt in zip(approx.double(), x.double(), strict=True):
        top = a.max().item()
        near = [v for v in range(a.numel()) if a[v] >= top - margin]
        near.sort(key=lambda v: -a[v].item())
        near = near[:cap] if len(near) > cap else near
        exact = {v: (rows[v].double() @ xt).item() for v in near}
        best = min(near, key=lambda v: (-exact[v], v))
        logits = a.clone()
        for v in near:
            logits[v] = exact[v]
        tokens.append(best)
        probs.append(math.exp(exact[best] - top) / torch.exp(logits - top).sum().item())
    return tokens, probs


@pytest.mark.parametrize("vocab,width,rows,cap", [(1000, 64, 3, 16), (517, 96, 1, 4),
                                                  (2048, 32, 5, 2)])
def test_the_pick_against_a_reference(vocab: int, width: int, rows: int, cap: int) -> None:
    """Vocabularies not a multiple of 16 (the kernel's tail), ties in the exact logits (two equal
    rows: the lower id wins), more candidates than the cap (then the cap's largest)."""
    gen = torch.Generator().manual_seed(vocab)
    weight = (torch.randn(vocab, width, generator=gen) * 0.3).bfloat16()
    weight[vocab // 2] = weight[vocab // 3]  # an exact tie between two ids
    x = torch.randn(rows, width, generator=gen).bfloat16()
    approx = ((x.double() @ weight.double().T)
              + torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 0.2).bfloat16()
    token = torch.empty(rows, dtype=torch.int64)
    prob = torch.empty(rows, dtype=torch.float32)
    lib = native.load()
    lib.banyan_draft_pick(approx.data_ptr(), rows, vocab, x.data_ptr(), width,
                          weight.data_ptr(), cap, 1.5, token.data_ptr(), prob.data_ptr())
    want_tokens, want_probs = reference_pick(approx, x, weight, cap, 1.5)
    assert token.tolist() == want_tokens
    assert prob.tolist() == pytest.approx(want_probs, rel=1e-2)  # (float32 sums and exp)


def test_the_head_picks_what_the_plain_head_would(llama_dir: Path) -> None:
    """A bf16 runner's head made a DraftHead (no size bar): over steps of real hidden states
    the picks equal the plain logits' argmax but where the top two are within the copy's error,
    and the probabilities stay close; a float32 runner keeps the plain path."""
    runner = ModelRunner(llama_dir, dtype="bfloat16", max_rows=1, kv_cache_bytes=16 << 20)
    head = DraftHead.build(runner.model, runner.device, runner.dtype, min_bytes=0)
    assert head is not None
    prompt = [(37 * i) % 500 + 3 for i in range(120)]
    batch = ForwardBatch(rows=[0], prefix_lens=[0], extend_lens=[len(prompt)],
                         input_ids=prompt, out_slots=list(range(1, 1 + len(prompt))),
                         sample_indices=[0])
    inputs = runner.prepare(batch)
    inputs.logit_tokens = torch.arange(len(prompt))  # every position's hidden state
    inputs.every_token = True
    hidden, _ = runner.compute_hidden(inputs)
    assert hidden is not None and hidden.shape[0] == len(prompt)
    with torch.inference_mode():
        logits = runner.model.compute_logits(hidden)
    want, want_p = top_token_and_probability(logits)
    got, got_p = head.pick(hidden)
    second = logits.topk(2, dim=1).values
    clear = (second[:, 0] - second[:, 1] > 0.05).tolist()
    assert all(g == w for g, w, c in zip(got, want, clear, strict=True) if c)
    assert sum(clear) > len(prompt) // 2
    assert got_p == pytest.approx(want_p, abs=0.05)
    plain = runner.model.lm_head
    assert plain is not None  # the head's values out of its bf16 pairs or oneDNN's packed copy
    values = (plain.method.dequantized_weight(plain)  # (AMX) as its own products give them
              if isinstance(plain.method, PackedBf16Method | PairsBf16Method)
              else plain.weight.float())  # (a plain head where no pairs kernel runs: AVX2)
    with torch.inference_mode():
        assert torch.allclose(plain(hidden[:4]).float(), hidden[:4].float() @ values.T,
                              rtol=1e-2, atol=1e-2)
    f32 = ModelRunner(llama_dir, dtype="float32", max_rows=1, kv_cache_bytes=16 << 20)
    assert DraftHead.build(f32.model, f32.device, f32.dtype, min_bytes=0) is None
    assert DraftHead.build(runner.model, runner.device, runner.dtype) is None  # a small head
    assert draft_head.MIN_HEAD_BYTES > 512 * 64 * 2


def test_a_bf16_draft_guesses_through_its_head(llama_dir: Path) -> None:
    """In the engine: a bf16 target as its own draft, the draft's head picked from its 4-bit
    copy (no size bar): the draft's guesses come from the pick, most of them hold, and every
    slot of both pools is free at the end (the outputs are checked token for token against
    transformers in float32, where the plain head runs: test_speculative.py)."""
    with Engine(str(llama_dir), dtype="bfloat16", device="cpu", disable_tqdm=True,
                overlap="off", speculative_algorithm="draft", spec_draft_model=str(llama_dir),
                spec_draft_min_confidence=0.0, spec_draft_no_lookup=True,
                speculative_max_step_tokens=64) as engine:
        spec = engine.core.scheduler.speculation
        proposer = spec.proposer
        proposer.head = DraftHead.build(proposer.runner.model, proposer.runner.device,
                                        proposer.runner.dtype, min_bytes=0)
        picks = []
        pick = proposer.head.pick
        proposer.head.pick = lambda hidden: picks.append(len(hidden)) or pick(hidden)
        prompts = [[(13 * i + j) % 500 + 3 for i in range(40 + 7 * j)] for j in range(3)]
        engine.generate(input_ids=prompts, sampling_params=[
            SamplingParams(max_new_tokens=24, temperature=0.0) for _ in prompts])
        assert sum(picks) > 0 and spec.stats.num_drafts > 0
        assert spec.stats.acceptance_rate > 0.5
        assert proposer.allocator.num_free == proposer.allocator.capacity
        check_pool_empty(engine)
