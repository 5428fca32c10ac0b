"""Benchmark workload generators: exact lengths, determinism for a seed, group and conversation
structure, the optimum of prefix reuse, and text prompts of exact token length."""

from __future__ import annotations

from pathlib import Path

import pytest

from banyan.bench.workloads import (
    Workload,
    agent_workload,
    from_prompts,
    multi_turn_workload,
    optimal_reuse,
    random_workload,
    shared_prefix_workload,
    tree_of_thought_workload,
)

VOCAB = 49152


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def all_workloads(seed: int) -> list[Workload]:
    return [
        random_workload(16, 32, 8, VOCAB, 0.5, seed),
        shared_prefix_workload(3, 4, 40, 6, 5, VOCAB, seed),
        multi_turn_workload(3, 4, 20, 6, 5, VOCAB, seed),
        agent_workload(2, 4, 50, 8, 7, 3, VOCAB, seed),
        tree_of_thought_workload(2, 3, 2, 12, 4, 5, VOCAB, seed),
    ]


def test_same_seed_same_workload_other_seed_other_prompts() -> None:
    for a, b, c in zip(all_workloads(1), all_workloads(1), all_workloads(2)):
        assert a.requests == b.requests, a.name
        assert a.reusable_tokens == b.reusable_tokens
        assert [r.prompt_ids for r in a.requests] != [r.prompt_ids for r in c.requests], a.name


def test_token_ids_stay_in_range() -> None:
    for w in all_workloads(3):
        for r in w.requests:
            assert all(3 <= t < VOCAB for t in r.prompt_ids + r.answer_ids), w.name


def test_random_lengths_exact_and_in_range() -> None:
    w = random_workload(64, 128, 128, VOCAB, seed=0)
    assert [len(r.prompt_ids) for r in w.requests] == [128] * 64
    assert [r.output_len for r in w.requests] == [128] * 64
    assert w.prompt_tokens == 64 * 128 and not w.dependent
    w = random_workload(200, 100, 50, VOCAB, range_ratio=0.5, seed=0)
    ins = [len(r.prompt_ids) for r in w.requests]
    outs = [r.output_len for r in w.requests]
    assert min(ins) >= 50 and max(ins) <= 100 and len(set(ins)) > 10
    assert min(outs) >= 25 and max(outs) <= 50
    assert w.reusable_tokens == 0


@pytest.mark.parametrize("shuffle", [True, False])
def test_shared_prefix_groups(shuffle: bool) -> None:
    g, p, s, q, o = 4, 5, 64, 16, 8
    w = shared_prefix_workload(g, p, s, q, o, VOCAB, seed=5, shuffle=shuffle)
    assert len(w.requests) == g * p
    assert all(len(r.prompt_ids) == s + q and r.output_len == o for r in w.requests)
    by_group: dict[int, list[list[int]]] = {}
    for r in w.requests:
        by_group.setdefault(r.group, []).append(r.prompt_ids)
    assert sorted(by_group) == list(range(g)) and all(len(v) == p for v in by_group.values())
    for prompts in by_group.values():
        assert all(lcp(prompts[0], other) == s for other in prompts[1:])  # exactly the system
    systems = [v[0][:s] for v in by_group.values()]
    assert all(lcp(a, b) < s for i, a in enumerate(systems) for b in systems[i + 1:])
    order = [r.group for r in w.requests]
    assert (order == sorted(order)) == (not shuffle)
    assert w.reusable_tokens == g * (p - 1) * s


def test_multi_turn_conversations() -> None:
    c, t, first, turn, o = 3, 4, 20, 6, 5
    w = multi_turn_workload(c, t, first, turn, o, VOCAB, seed=0)
    assert len(w.requests) == c * t and w.dependent
    prompts = w.scripted_prompts()
    lens = w.prompt_lens()
    assert lens == [len(p) for p in prompts]
    for i, r in enumerate(w.requests):
        k = i // c  # listed turn by turn
        assert r.group == i % c
        assert lens[i] == first + (k + 1) * turn + k * o
        if k == 0:
            assert r.parent is None
        else:
            parent = w.requests[r.parent]
            assert r.parent == i - c and parent.group == r.group
            # the history: the previous prompt and its answer, then the new message
            assert prompts[i] == prompts[r.parent] + parent.answer_ids + r.prompt_ids
            assert len(parent.answer_ids) == o
    assert w.children()[0] == [c] and w.roots() == list(range(c))
    # the engine's own answers are in its cache ("model"); scripted answers are not
    assert w.reusable("model") == sum(lens[i - c] + o for i in range(c, c * t))
    assert w.reusable("scripted") == sum(lens[i - c] for i in range(c, c * t))


def test_agent_shares_tools_prefix_and_appends_results() -> None:
    agents, calls, tools, task, result, o = 3, 4, 50, 8, 7, 3
    w = agent_workload(agents, calls, tools, task, result, o, VOCAB, seed=0)
    prompts = w.scripted_prompts()
    assert len(w.requests) == agents * calls
    head = prompts[0][:tools]
    assert all(p[:tools] == head for p in prompts)
    for i, r in enumerate(w.requests):
        k = i // agents
        assert len(prompts[i]) == tools + task + k * (o + result)
        if r.parent is not None:
            assert len(r.prompt_ids) == result
            assert prompts[i][:len(prompts[r.parent]) + o] == (
                prompts[r.parent] + w.requests[r.parent].answer_ids)


def test_tree_of_thought_branches() -> None:
    trees, b, depth, q, bl, o = 2, 3, 3, 12, 4, 5
    w = tree_of_thought_workload(trees, b, depth, q, bl, o, VOCAB, seed=0)
    assert len(w.requests) == trees * (b + b**2 + b**3)
    kids = w.children()
    prompts = w.scripted_prompts()
    roots = w.roots()
    assert len(roots) == trees * b
    for i, r in enumerate(w.requests):
        if r.parent is None:
            assert len(prompts[i]) == q + bl
        else:
            parent = w.requests[r.parent]
            assert parent.group == r.group
            assert prompts[i] == prompts[r.parent] + parent.answer_ids + r.prompt_ids
        leaf = not kids[i]
        assert leaf or len(kids[i]) == b
        assert (r.answer_ids == []) == leaf
    assert max(w.prompt_lens()) == q + depth * bl + (depth - 1) * o


def test_optimal_reuse_by_hand() -> None:
    assert optimal_reuse([[1, 2, 3], [1, 2, 4], [1, 2, 3], [9]]) == 2 + 2 + 0
    # the last prompt equals an earlier one: one token is still computed
    assert optimal_reuse([[5, 6, 7], [5, 6, 7]]) == 2
    # an earlier answer extends what is cached
    assert optimal_reuse([[1, 2], [1, 2, 8, 9, 3]], [[8, 9], []]) == 4
    assert optimal_reuse([[1, 2], [1, 2, 8, 9, 3]]) == 2


def test_from_prompts() -> None:
    w = from_prompts("x", [[4, 5, 6], [4, 5, 7]], [2, 3])
    assert [r.output_len for r in w.requests] == [2, 3]
    assert w.reusable_tokens == 2


def test_text_prompts_have_exact_token_lengths(tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    from banyan.bench.text import TextPrompts, chat_prompt_ids

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    texts = TextPrompts(tok)
    assert texts.check()
    w = shared_prefix_workload(2, 3, 40, 9, 4, tok.vocab_size, seed=0)
    encoded = []
    for r in w.requests:
        text = texts.text(r.prompt_ids)
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) == len(r.prompt_ids)
        encoded.append((r.group, ids))
    same = [ids for g, ids in encoded if g == encoded[0][0]]
    assert lcp(same[0], same[1]) >= 40  # the shared system prompt survives as text
    # lengths that need trimming or padding still come out exact
    for ids in ([5, 77, 300, 41] * 7, list(range(3, 60))):
        assert len(tok.encode(texts.exact_text(ids), add_special_tokens=False)) == len(ids)
    messages = [{"role": "user", "content": texts.text([7] * 10)}]
    n = len(chat_prompt_ids(tok, messages))
    assert n > 10  # the template's role markers on top of the 10 content tokens
