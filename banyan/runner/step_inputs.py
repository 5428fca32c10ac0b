"""What a prepared step hands the model runner's compute: its tensors on the device
(StepInputs), the inputs the step before fills in (DeferredInputs), a mixed step's second part
(LongPart, runner/mixed_step.py), and how the parts' outputs merge back into the step's order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch

from banyan.attention.base import AttentionMetadata
from banyan.batch import ForwardBatch, TokenLogprobs
from banyan.runner.prompt_logprobs import PromptLogprobInputs


@dataclass(slots=True)
class DeferredInputs:
    """Input tokens sampled by the step before (overlap): fill input_ids[flat] from the
    runner's per-row token buffer at rows, once that step has run."""

    flat: torch.Tensor  # [D] int64 indices into input_ids
    rows: torch.Tensor  # [D] int64 table rows


@dataclass(slots=True)
class BurstInputs:
    """A burst's later decode steps (ForwardBatch.decode_steps): the KV slots of their inputs
    (int64 [steps - 1, B], already in the table) and the tokens after which it stops."""

    later_slots: torch.Tensor
    stops: frozenset[int]


@dataclass(slots=True)
class StepInputs:
    """A step's tensors on the device, built once from the batch's lists."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    logit_tokens: torch.Tensor | None  # [L] int64 flat index of each token whose logits are needed
    attn_meta: AttentionMetadata
    deferred: DeferredInputs | None = None
    prompt: PromptLogprobInputs | None = None  # prompt-logprob positions, when some request asks
    # A decode step a captured CUDA graph may replay: its batch and out slots (the replay
    # refills the static buffers when it runs, in step order, not when the step is prepared).
    graph: tuple[ForwardBatch, torch.Tensor] | None = None
    every_token: bool = False  # logit_tokens is every token in order: the head takes hidden
    # A mixed step's long requests, run after these short ones (runner/mixed_step.py)
    long_part: LongPart | None = None
    burst: BurstInputs | None = None

    def parts(self) -> list[StepInputs]:
        """The forwards this step runs, in order."""
        return [self] if self.long_part is None else [self, self.long_part.inputs]


@dataclass(slots=True)
class LongPart:
    """The long requests of a mixed step, and where the two parts' outputs go in its order
    (mixed_step.MixedSplit's orders, the logit one on the device)."""

    inputs: StepInputs
    logit_order: torch.Tensor
    prompt_order: list[int]


Rows = TypeVar("Rows", torch.Tensor, torch.Tensor | None)


def merge_parts(outs: list[tuple[Rows, list[list[TokenLogprobs]]]], long: LongPart
                ) -> tuple[Rows, list[list[TokenLogprobs]]]:
    """Both parts' (rows at their logit tokens, or None for none; prompt logprobs) -> the
    step's, in its order."""
    rows = [r for r, _ in outs if r is not None]
    merged = None
    if rows:
        merged = torch.cat(rows).index_select(0, long.logit_order)
    prompts = [span for _, p in outs for span in p]
    return merged, [prompts[i] for i in long.prompt_order]  # type: ignore[return-value]
