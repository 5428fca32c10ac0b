"""Seeded benchmark workloads as token ids of exact lengths, shared by `bench offline`,
`bench serve` and the peers under benchmarks/peers/.

A workload is a list of requests in submission order. A request may continue another one
(`parent`): its prompt is then the parent's whole conversation (the parent's prompt and the
parent's answer) followed by its own `prompt_ids`. That one link describes multi-turn chat (a
chain per conversation), agent loops (a chain per agent, all under one tool prefix) and tree of
thought (a tree per question). The answer put into the history is either what the engine
generated (offline, history="model") or the parent's scripted `answer_ids` (history="scripted":
the serve client always, since the OpenAI API returns text, not token ids; every engine then sees
the same prompts token for token). Lengths are exact either way: requests run with ignore_eos, so
every answer has exactly output_len tokens, and the scripted answers have that length too; a
workload of real tasks (`stop_at_eos`: input-grounded generation) lets answers end at EOS.

This module imports nothing heavy (no torch), so peer scripts in other virtual environments can
use it.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

WORKLOADS = ("random", "shared-prefix", "multi-turn", "agent", "tree-of-thought")


@dataclass(slots=True)
class BenchRequest:
    prompt_ids: list[int]  # the request's own tokens, after its parent's conversation
    output_len: int
    group: int = 0  # requests of one group share a prefix (group, conversation, agent, tree)
    parent: int | None = None  # index of the request this one continues
    answer_ids: list[int] = field(default_factory=list)  # scripted answer, when it has children


@dataclass(slots=True)
class Workload:
    name: str
    requests: list[BenchRequest]
    # Prompt tokens a perfect prefix cache could serve (the optimum for the hit rate).
    reusable_tokens: int = 0
    params: dict[str, object] = field(default_factory=dict)
    # Answers end where the model ends them (output_len is then a limit): a workload of real
    # tasks, whose tokens past the answer would be the model inventing a next turn. Only for
    # workloads no other request continues (a history needs its exact length).
    stop_at_eos: bool = False

    def __post_init__(self) -> None:
        if self.stop_at_eos and self.dependent:
            raise ValueError("stop_at_eos: a dependent workload needs answers of exact length")

    @property
    def dependent(self) -> bool:
        """True when some request continues another (it can only start once that one ended)."""
        return any(r.parent is not None for r in self.requests)

    @property
    def prompt_tokens(self) -> int:
        return sum(self.prompt_lens())

    def prompt_lens(self) -> list[int]:
        """Full prompt length of every request (history included)."""
        full: list[int] = []
        for r in self.requests:
            history = 0 if r.parent is None else full[r.parent] + self.requests[r.parent].output_len
            full.append(history + len(r.prompt_ids))
        return full

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in self.requests]
        for i, r in enumerate(self.requests):
            if r.parent is not None:
                kids[r.parent].append(i)
        return kids

    def roots(self) -> list[int]:
        return [i for i, r in enumerate(self.requests) if r.parent is None]

    def prompt(self, index: int, conversations: Mapping[int, Sequence[int]]) -> list[int]:
        """The full prompt of request `index`; `conversations[parent]` is the parent's prompt plus
        its answer (the driver records it when the parent ends)."""
        r = self.requests[index]
        if r.parent is None:
            return list(r.prompt_ids)
        return list(conversations[r.parent]) + r.prompt_ids

    def scripted_prompts(self) -> list[list[int]]:
        """Every full prompt, with the scripted answers in the histories."""
        prompts: list[list[int]] = []
        conv: dict[int, list[int]] = {}
        kids = self.children()
        for i, r in enumerate(self.requests):
            prompts.append(self.prompt(i, conv))
            if kids[i]:
                conv[i] = prompts[i] + r.answer_ids
        return prompts

    def reusable(self, history: str = "model") -> int:
        """The optimum of prefix reuse. history="model": the engine caches its own answers and
        the next prompt holds them (offline); "scripted": the next prompt holds the scripted
        answer, which the engine never computed, so only earlier prompts can be reused."""
        answers = [r.answer_ids for r in self.requests] if history == "model" else None
        return optimal_reuse(self.scripted_prompts(), answers)

    def max_seq_len(self) -> int:
        return max((n + r.output_len for n, r in zip(self.prompt_lens(), self.requests)),
                   default=0)


def optimal_reuse(prompts: Sequence[Sequence[int]],
                  answers: Sequence[Sequence[int]] | None = None) -> int:
    """Prompt tokens a perfect, unbounded prefix cache serves when `prompts` are sent in this
    order: for each, its longest common prefix with every earlier prompt (followed by that
    request's answer, when `answers` says what the engine generated and cached). At least one
    prompt token is always computed."""
    trie: dict[int, dict] = {}
    total = 0
    for i, prompt in enumerate(prompts):
        node, matched = trie, 0
        for tok in prompt:
            nxt = node.get(tok)
            if nxt is None:
                break
            node, matched = nxt, matched + 1
        total += min(matched, len(prompt) - 1)
        node = trie
        for tok in itertools.chain(prompt, answers[i] if answers is not None else ()):
            node = node.setdefault(tok, {})
    return total


def _tokens(rng: random.Random, n: int, vocab: int, first_id: int) -> list[int]:
    return [rng.randrange(first_id, vocab) for _ in range(n)]


def _finish(name: str, reqs: list[BenchRequest], params: dict[str, object]) -> Workload:
    workload = Workload(name, reqs, 0, params)
    workload.reusable_tokens = workload.reusable("model")
    return workload


def random_workload(num_requests: int, input_len: int, output_len: int, vocab: int,
                    range_ratio: float = 1.0, seed: int = 0, first_id: int = 3) -> Workload:
    """Lengths drawn in [len * range_ratio, len]; ids uniform in [first_id, vocab)."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(num_requests):
        n_in = rng.randint(max(1, int(input_len * range_ratio)), input_len)
        n_out = rng.randint(max(1, int(output_len * range_ratio)), output_len)
        reqs.append(BenchRequest(_tokens(rng, n_in, vocab, first_id), n_out))
    return _finish("random", reqs, dict(num_requests=num_requests, input_len=input_len,
                                        output_len=output_len, range_ratio=range_ratio,
                                        seed=seed))


def shared_prefix_workload(groups: int, prompts_per_group: int, system_len: int,
                           question_len: int, output_len: int, vocab: int, seed: int = 0,
                           shuffle: bool = True, first_id: int = 3) -> Workload:
    """G groups x P prompts: an S-token system prompt per group plus a Q-token question, O
    output tokens, shuffled (the shape of SGLang's generated-shared-prefix benchmark)."""
    rng = random.Random(seed)
    reqs = []
    for g in range(groups):
        system = _tokens(rng, system_len, vocab, first_id)
        for _ in range(prompts_per_group):
            reqs.append(BenchRequest(system + _tokens(rng, question_len, vocab, first_id),
                                     output_len, group=g))
    if shuffle:
        rng.shuffle(reqs)
    return _finish("shared-prefix", reqs, dict(
        groups=groups, prompts_per_group=prompts_per_group, system_len=system_len,
        question_len=question_len, output_len=output_len, seed=seed, shuffle=shuffle))


def multi_turn_workload(conversations: int, turns: int, first_len: int, turn_len: int,
                        output_len: int, vocab: int, seed: int = 0,
                        first_id: int = 3) -> Workload:
    """C conversations x T turns: turn 0 is a first_len-token opening plus a turn_len-token
    message; turn t resends the whole history (earlier prompts and answers) plus a new
    turn_len-token message. Turns of one conversation are sequential; conversations run
    concurrently. Requests are listed turn by turn (group = conversation)."""
    rng = random.Random(seed)
    opening = [_tokens(rng, first_len, vocab, first_id) for _ in range(conversations)]
    messages = [[_tokens(rng, turn_len, vocab, first_id) for _ in range(turns)]
                for _ in range(conversations)]
    answers = [[_tokens(rng, output_len, vocab, first_id) for _ in range(turns)]
               for _ in range(conversations)]
    reqs: list[BenchRequest] = []
    last: list[int | None] = [None] * conversations
    for t in range(turns):
        for c in range(conversations):
            own = (opening[c] if t == 0 else []) + messages[c][t]
            answer = answers[c][t] if t < turns - 1 else []
            reqs.append(BenchRequest(own, output_len, group=c, parent=last[c],
                                     answer_ids=answer))
            last[c] = len(reqs) - 1
    return _finish("multi-turn", reqs, dict(conversations=conversations, turns=turns,
                                            first_len=first_len, turn_len=turn_len,
                                            output_len=output_len, seed=seed))


def agent_workload(agents: int, calls: int, tools_len: int, task_len: int, result_len: int,
                   output_len: int, vocab: int, seed: int = 0, first_id: int = 3) -> Workload:
    """An agent loop: one long fixed tool description (tools_len tokens) that every call of
    every agent starts with, a task_len-token task per agent, then `calls` short calls per
    agent; each call's answer (output_len tokens, the tool call) and the tool's result
    (result_len tokens) are appended for the next call. Agents run concurrently, their calls
    in sequence (group = agent)."""
    rng = random.Random(seed)
    tools = _tokens(rng, tools_len, vocab, first_id)
    reqs: list[BenchRequest] = []
    last: list[int | None] = [None] * agents
    tasks = [_tokens(rng, task_len, vocab, first_id) for _ in range(agents)]
    for k in range(calls):
        for a in range(agents):
            own = tools + tasks[a] if k == 0 else _tokens(rng, result_len, vocab, first_id)
            answer = _tokens(rng, output_len, vocab, first_id) if k < calls - 1 else []
            reqs.append(BenchRequest(own, output_len, group=a, parent=last[a],
                                     answer_ids=answer))
            last[a] = len(reqs) - 1
    return _finish("agent", reqs, dict(agents=agents, calls=calls, tools_len=tools_len,
                                       task_len=task_len, result_len=result_len,
                                       output_len=output_len, seed=seed))


def tree_of_thought_workload(trees: int, branches: int, depth: int, question_len: int,
                             branch_len: int, output_len: int, vocab: int, seed: int = 0,
                             first_id: int = 3) -> Workload:
    """Tree of thought: per tree a question_len-token question; B branches continue it (each
    with its own branch_len-token instruction, then output_len tokens of thought), and every
    branch forks again into B, down to `depth` levels: B + B^2 + ... + B^depth requests per
    tree. A branch starts when its parent thought is done; trees run concurrently. Requests
    are listed level by level (group = tree)."""
    rng = random.Random(seed)
    reqs: list[BenchRequest] = []
    level: list[tuple[int, int | None, list[int]]] = []  # (tree, parent, question or [])
    for t in range(trees):
        level.append((t, None, _tokens(rng, question_len, vocab, first_id)))
    for d in range(depth):
        nxt: list[tuple[int, int | None, list[int]]] = []
        for tree, parent, question in level:
            for _ in range(branches):
                own = question + _tokens(rng, branch_len, vocab, first_id)
                answer = _tokens(rng, output_len, vocab, first_id) if d < depth - 1 else []
                reqs.append(BenchRequest(own, output_len, group=tree, parent=parent,
                                         answer_ids=answer))
                nxt.append((tree, len(reqs) - 1, []))
        level = nxt
    return _finish("tree-of-thought", reqs, dict(
        trees=trees, branches=branches, depth=depth, question_len=question_len,
        branch_len=branch_len, output_len=output_len, seed=seed))


def from_prompts(name: str, prompts: Sequence[Sequence[int]], output_lens: Sequence[int],
                 groups: Sequence[int] | None = None) -> Workload:
    """Independent requests given as token ids (what the peer workers receive)."""
    reqs = [BenchRequest(list(p), int(o), group=0 if groups is None else int(groups[i]))
            for i, (p, o) in enumerate(zip(prompts, output_lens, strict=True))]
    return _finish(name, reqs, {"num_requests": len(reqs)})
