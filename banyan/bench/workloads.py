"""Seeded benchmark workloads as token ids of exact lengths."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(slots=True)
class BenchRequest:
    prompt_ids: list[int]
    output_len: int
    group: int = 0  # requests of one group share a prefix


@dataclass(slots=True)
class Workload:
    name: str
    requests: list[BenchRequest]
    # Prompt tokens a perfect prefix cache could serve (the optimum for the hit rate).
    reusable_tokens: int = 0
    params: dict[str, object] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_ids) for r in self.requests)


def _tokens(rng: random.Random, n: int, vocab: int, first_id: int) -> list[int]:
    return [rng.randrange(first_id, vocab) for _ in range(n)]


def random_workload(num_requests: int, input_len: int, output_len: int, vocab: int,
                    range_ratio: float = 1.0, seed: int = 0, first_id: int = 3) -> Workload:
    """Lengths drawn in [len * range_ratio, len]; ids uniform in [first_id, vocab)."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(num_requests):
        n_in = rng.randint(max(1, int(input_len * range_ratio)), input_len)
        n_out = rng.randint(max(1, int(output_len * range_ratio)), output_len)
        reqs.append(BenchRequest(_tokens(rng, n_in, vocab, first_id), n_out))
    return Workload("random", reqs, 0, dict(num_requests=num_requests, input_len=input_len,
                                            output_len=output_len, range_ratio=range_ratio, seed=seed))


def shared_prefix_workload(groups: int, prompts_per_group: int, system_len: int,
                           question_len: int, output_len: int, vocab: int, seed: int = 0,
                           shuffle: bool = True, first_id: int = 3) -> Workload:
    """G groups x P prompts: an S-token system prompt per group plus a Q-token question."""
    rng = random.Random(seed)
    reqs = []
    for g in range(groups):
        system = _tokens(rng, system_len, vocab, first_id)
        for _ in range(prompts_per_group):
            reqs.append(BenchRequest(system + _tokens(rng, question_len, vocab, first_id),
                                     output_len, group=g))
    if shuffle:
        rng.shuffle(reqs)
    reusable = groups * (prompts_per_group - 1) * system_len
    return Workload("shared-prefix", reqs, reusable, dict(
        groups=groups, prompts_per_group=prompts_per_group, system_len=system_len,
        question_len=question_len, output_len=output_len, seed=seed, shuffle=shuffle))


@dataclass(slots=True)
class MultiTurnWorkload:
    """C conversations x T turns: turn t resends the whole history (earlier prompts and answers)
    plus a new user message of `turn_len` tokens. Turns of one conversation are sequential."""

    system: list[list[int]]  # per conversation: its first message
    messages: list[list[list[int]]]  # [conversation][turn] -> the new user tokens of that turn
    output_len: int
    params: dict[str, object] = field(default_factory=dict)


def multi_turn_workload(conversations: int, turns: int, first_len: int, turn_len: int,
                        output_len: int, vocab: int, seed: int = 0,
                        first_id: int = 3) -> MultiTurnWorkload:
    rng = random.Random(seed)
    return MultiTurnWorkload(
        system=[_tokens(rng, first_len, vocab, first_id) for _ in range(conversations)],
        messages=[[_tokens(rng, turn_len, vocab, first_id) for _ in range(turns)]
                  for _ in range(conversations)],
        output_len=output_len,
        params=dict(conversations=conversations, turns=turns, first_len=first_len,
                    turn_len=turn_len, output_len=output_len, seed=seed),
    )
