"""Several tokens per request on the real runner: logits at every proposed position, the
accepted prefix plus the model's own token, KV of rejected guesses handed back."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from banyan import Engine, SamplingParams
from banyan.scheduler import Request
from banyan.scheduler.speculation import Speculation, SpeculationConfig
from tests.hf_reference import hf_greedy
from tests.test_engine import check_pool_empty, prompts_1_to_300


class OracleProposer:
    """Proposes the reference continuation, every `wrong`-th token spoiled."""

    def __init__(self, expected: dict[tuple[int, ...], list[int]], wrong: int) -> None:
        self.expected = expected
        self.wrong = wrong
        self.proposed = 0

    def propose(self, reqs: Sequence[Request], max_tokens: Sequence[int]) -> list[list[int]]:
        return [self._guess(req, k) for req, k in zip(reqs, max_tokens, strict=True)]

    def forget(self, req: Request) -> None:
        pass

    def seconds_per_position(self, requests: int) -> float:
        return 0.0

    def _guess(self, req: Request, max_tokens: int) -> list[int]:
        want = self.expected[tuple(req.prompt_ids)][len(req.output_ids):][:max_tokens]
        guess = []
        for t in want:
            self.proposed += 1
            guess.append(t + 1 if self.wrong and self.proposed % self.wrong == 0 else t)
        return guess


@pytest.mark.parametrize("wrong", [0, 2])
def test_verified_proposals_match_transformers(llama_dir: Path, wrong: int) -> None:
    prompts = prompts_1_to_300(6, seed=8)
    expected = {tuple(p): hf_greedy(llama_dir, p, 14) for p in prompts}
    with Engine(str(llama_dir), dtype="float32", device="cpu", disable_tqdm=True,
                overlap="off") as engine:
        sched = engine.core.scheduler
        sched.config.check_integrity = True
        sched.speculation = Speculation(OracleProposer(expected, wrong),
                                        SpeculationConfig(num_tokens=3, max_step_tokens=64))
        sched.builder.speculation = sched.speculation
        outs = engine.generate(input_ids=prompts, sampling_params=SamplingParams(
            max_new_tokens=14, temperature=0.0, logprobs=1))
        for p, out in zip(prompts, outs, strict=True):
            assert out.output_ids == expected[tuple(p)]
            assert len(out.outputs[0].logprobs) == 14
        check_pool_empty(engine)
