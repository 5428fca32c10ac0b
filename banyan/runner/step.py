"""The scheduler's Runner: a model forward plus the sampler, one StepOutput per ForwardBatch."""

from __future__ import annotations

import time

from banyan.batch import ForwardBatch, StepOutput
from banyan.runner.model_runner import ModelRunner
from banyan.sampling.sampler import Sampler


class ModelStepRunner:
    def __init__(self, model_runner: ModelRunner, sampler: Sampler) -> None:
        self.model_runner = model_runner
        self.sampler = sampler

    def run(self, batch: ForwardBatch) -> StepOutput:
        logits = self.model_runner.forward(batch)  # [S, V] float32
        t0 = time.perf_counter()
        result = self.sampler.sample(logits, batch.sampling)
        timings = dict(self.model_runner.timings)
        timings["sample"] = time.perf_counter() - t0
        return StepOutput(result.next_tokens, result.logprobs, timings)
