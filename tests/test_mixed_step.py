"""A step mixing decodes and checks with prefill chunks runs as two forwards
(banyan/runner/mixed_step.py): the split itself (parts, deferred inputs, prompt-logprob spans,
the orders that merge the outputs back), and a runner's logits for such a step, each request's
bit for bit those it has in a step of its own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from banyan.batch import ForwardBatch, PromptLogprobSpan
from banyan.runner.mixed_step import split_mixed_step
from tests.model_helpers import make_runner, random_ids


def test_decodes_and_checks_go_first_and_the_outputs_back_in_step_order() -> None:
    # a prefill that ends its prompt, a decode, a prefill chunk mid-prompt, a 3-guess check
    batch = ForwardBatch(
        rows=[4, 7, 2, 5], prefix_lens=[0, 30, 10, 40], extend_lens=[20, 1, 25, 4],
        input_ids=list(range(50)), out_slots=list(range(100, 150)),
        sample_indices=[0, 1, 3], proposed=[[], [], [46, 47, 48]],
        deferred_inputs=[20, 46],  # the decode's token and the check's first
        prompt_logprobs=[PromptLogprobSpan(2, 10, [1] * 25, 0),
                         PromptLogprobSpan(0, 0, [2] * 20, 0)])
    split = split_mixed_step(batch)
    assert split is not None
    short, long = split.short, split.long
    assert (short.rows, short.extend_lens, short.prefix_lens) == ([7, 5], [1, 4], [30, 40])
    assert short.input_ids == [20, 46, 47, 48, 49] and short.out_slots == [120, 146, 147, 148, 149]
    assert short.sample_indices == [0, 1] and short.proposed == [[], [46, 47, 48]]
    assert short.deferred_inputs == [0, 1]
    assert (long.rows, long.extend_lens, long.sample_indices) == ([4, 2], [20, 25], [0])
    assert long.input_ids == list(range(20)) + list(range(21, 46))
    assert [s.index for s in long.prompt_logprobs] == [1, 0] and not short.prompt_logprobs
    # logit rows of the step: the prefill's 1, the decode's 1, the check's 4; the short part's
    # rows (decode, check: 0..4) come before the long part's (the prefill: 5)
    assert split.logit_order == [5, 0, 1, 2, 3, 4]
    assert split.prompt_order == [0, 1]


def test_steps_that_need_no_split() -> None:
    decodes = ForwardBatch(rows=[0, 1], prefix_lens=[5, 6], extend_lens=[1, 1],
                           input_ids=[1, 2], out_slots=[1, 2], sample_indices=[0, 1])
    assert split_mixed_step(decodes) is None
    prefills = ForwardBatch(rows=[0, 1], prefix_lens=[0, 0], extend_lens=[30, 2],
                            input_ids=[1] * 32, out_slots=list(range(32)), sample_indices=[0])
    assert split_mixed_step(prefills) is None  # (the 2-token chunk samples nothing)
    many = ForwardBatch(rows=list(range(18)), prefix_lens=[9] * 17 + [0],
                        extend_lens=[1] * 17 + [40], input_ids=[1] * 57,
                        out_slots=list(range(57)), sample_indices=list(range(17)))
    assert split_mixed_step(many) is None  # 17 decodes take the GEMM in a step of their own too


@pytest.mark.parametrize("dtype,quantization", [("float32", "none"), ("bfloat16", "int8"),
                                                ("float32", "int4")])
def test_a_mixed_step_gives_each_request_the_logits_of_its_own_step(
        llama_dir: Path, dtype: str, quantization: str) -> None:
    """A decode, a 4-token check and a 150-token prefill in one step: each request's logits are
    those a step of its own gives (the long chunk's GEMMs used to take the decode's and the
    check's tokens too)."""
    # (float32: the skinny kernel, whose tokens get their bits alone; F.linear's GEMV and GEMM
    # differ, and "auto" picks it where it measured faster)
    runner = make_runner(llama_dir, dtype=dtype, quantization=quantization, max_rows=8,
                         linear_kernel="native" if quantization == "none" else "auto")
    prompts = [random_ids(60, 1), random_ids(70, 2), random_ids(150, 3)]
    slots = iter(range(1, 1024))

    def step(batch: ForwardBatch) -> torch.Tensor:
        with torch.inference_mode():
            return runner.forward(batch)

    def prefill(row: int, ids: list[int]) -> list[int]:
        out = [next(slots) for _ in ids]
        step(ForwardBatch(rows=[row], prefix_lens=[0], extend_lens=[len(ids)], input_ids=ids,
                          out_slots=out, sample_indices=[0]))
        return out

    decode, check = random_ids(1, 4), random_ids(4, 5)
    for base in (0, 3):  # rows 0-2: the mixed step; 3-5: each request alone
        prefill(base, prompts[0])
        prefill(base + 1, prompts[1])
    mixed = ForwardBatch(
        rows=[2, 0, 1], prefix_lens=[0, 60, 70], extend_lens=[150, 1, 4],
        input_ids=prompts[2] + decode + check, out_slots=[next(slots) for _ in range(155)],
        sample_indices=[0, 1, 2], proposed=[[], [], check[1:]])
    got = step(mixed)
    alone = [
        step(ForwardBatch(rows=[5], prefix_lens=[0], extend_lens=[150], input_ids=prompts[2],
                          out_slots=[next(slots) for _ in range(150)], sample_indices=[0])),
        step(ForwardBatch(rows=[3], prefix_lens=[60], extend_lens=[1], input_ids=decode,
                          out_slots=[next(slots)], sample_indices=[0])),
        step(ForwardBatch(rows=[4], prefix_lens=[70], extend_lens=[4], input_ids=check,
                          out_slots=[next(slots) for _ in range(4)], sample_indices=[0],
                          proposed=[check[1:]]))]
    assert got.shape == (6, runner.vocab_size)
    assert torch.equal(got, torch.cat(alone))


def test_prompt_logprobs_of_a_prefill_beside_a_decode(llama_dir: Path) -> None:
    """Two prefills asking for prompt logprobs beside a decode, their spans named in another
    order than the batch's: each span's logprobs are those its request's own step gives, in
    the order the step names them."""
    runner = make_runner(llama_dir, dtype="float32", max_rows=8, linear_kernel="native")
    prompts = [random_ids(40, 6), random_ids(30, 7), random_ids(50, 8)]
    slots = iter(range(1, 1024))

    def compute(batch: ForwardBatch) -> list[list[float]]:
        with torch.inference_mode():
            _, prompt = runner.compute(runner.prepare(batch))
        return [[lp.logprob for lp in span] for span in prompt]

    def span(index: int, ids: list[int]) -> PromptLogprobSpan:
        return PromptLogprobSpan(index, 0, ids[1:], 2)

    for row in (0, 3):  # the decoding request, in the mixed step's row and alone
        runner.forward(ForwardBatch(rows=[row], prefix_lens=[0], extend_lens=[40],
                                    input_ids=prompts[0], out_slots=[next(slots) for _ in
                                                                     range(40)],
                                    sample_indices=[0]))
    mixed = ForwardBatch(
        rows=[1, 0, 2], prefix_lens=[0, 40, 0], extend_lens=[30, 1, 50],
        input_ids=prompts[1] + [5] + prompts[2], out_slots=[next(slots) for _ in range(81)],
        sample_indices=[0, 1, 2], prompt_logprobs=[span(2, prompts[2]), span(0, prompts[1])])
    assert split_mixed_step(mixed) is not None
    got = compute(mixed)
    alone = [compute(ForwardBatch(rows=[5 + i], prefix_lens=[0], extend_lens=[len(ids)],
                                  input_ids=ids, out_slots=[next(slots) for _ in ids],
                                  sample_indices=[0], prompt_logprobs=[span(0, ids)]))[0]
             for i, ids in enumerate((prompts[2], prompts[1]))]
    assert got == alone
