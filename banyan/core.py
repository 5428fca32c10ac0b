"""EngineCore: the tokenizer-aware shell around the Scheduler that turns user requests into
scheduler Requests and steps them. Shared by the offline Engine and the server's engine process.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from banyan.args import EngineArgs
from banyan.sampling.params import SamplingParams
from banyan.scheduler import Request, RequestUpdate, Scheduler

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SampleGroup:
    """The n samples of one user request: child request ids in sample order."""

    rid: str
    child_rids: list[str]
    prompt_ids: list[int]


class EngineCore:
    def __init__(self, args: EngineArgs, scheduler: Scheduler, tokenizer: Any,
                 eos_ids: frozenset[int], vocab_size: int, max_model_len: int) -> None:
        self.args = args
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.weight_bytes = 0  # bytes of weights read per forward (for the bandwidth bound)

    @classmethod
    def from_args(cls, args: EngineArgs) -> EngineCore:
        from banyan.loading import build_engine_core

        return build_engine_core(args)

    def add(self, rid: str, prompt_ids: Sequence[int], params: SamplingParams,
            namespace: str | None = None) -> SampleGroup:
        """Validate and queue a request (n children when params.n > 1). ValueError names the
        problem; nothing is queued then."""
        params.validate(self.vocab_size)
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt is empty: at least one token is needed")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt)} tokens is too long: the context length is "
                f"{self.max_model_len} tokens (prompt plus at least one generated token)"
            )
        max_new = min(params.max_new_tokens, self.max_model_len - len(prompt))
        children = []
        for index in range(params.n):
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else params.seed + index
                child_params = params.copy(n=1, seed=seed)
            child_rid = rid if params.n == 1 else f"{rid}#{index}"
            children.append(Request(
                child_rid, prompt, child_params, max_new, eos_ids=self.eos_ids,
                namespace=namespace, text=self._text_stream(prompt, child_params),
            ))
        added: list[str] = []
        try:
            for req in children:
                self.scheduler.add_request(req)
                added.append(req.rid)
        except ValueError:
            for child_rid in added:
                self.scheduler.abort(child_rid)
            raise
        return SampleGroup(rid, added, prompt)

    def _text_stream(self, prompt: list[int], params: SamplingParams) -> Any:
        from banyan.detok import TextAccumulator

        return TextAccumulator.from_params(self.tokenizer, prompt, params)

    def step(self) -> list[RequestUpdate]:
        return self.scheduler.step()

    def abort(self, rid: str) -> RequestUpdate | None:
        return self.scheduler.abort(rid)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work
