"""The workload flags shared by `banyan bench offline` and `banyan bench serve`."""

from __future__ import annotations

import argparse
from typing import Any

from banyan.bench.workloads import (
    WORKLOADS,
    Workload,
    agent_workload,
    multi_turn_workload,
    random_workload,
    shared_prefix_workload,
    tree_of_thought_workload,
)

TEXT_WORKLOADS = ("grounded", "chat")  # chat prompts in words (banyan/bench/grounded.py)


def add_workload_args(parser: argparse.ArgumentParser, seed_flags: tuple[str, ...]) -> None:
    w = parser.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS + TEXT_WORKLOADS, default="random",
                   help="grounded (repeat/rewrite/edit a given text or code: speculation's best "
                        "case) and chat (free answers) are chat prompts for a real model, "
                        "offline only")
    w.add_argument("--num-requests", type=int, default=64, help="random: number of requests")
    w.add_argument("--input-len", type=int, default=128, help="random: prompt tokens")
    w.add_argument("--output-len", type=int, default=128,
                   help="output tokens of every request (random: the most)")
    w.add_argument("--range-ratio", type=float, default=1.0,
                   help="random: lengths are drawn in [len * ratio, len]")
    w.add_argument("--groups", type=int, default=8, help="shared-prefix: G groups")
    w.add_argument("--prompts-per-group", type=int, default=8, help="shared-prefix: P prompts")
    w.add_argument("--system-len", type=int, default=1024,
                   help="shared-prefix: S system tokens; multi-turn: tokens of the opening")
    w.add_argument("--question-len", type=int, default=64,
                   help="shared-prefix: Q question tokens; multi-turn: tokens of each new "
                        "message; agent: tokens of each task; tree-of-thought: the question")
    w.add_argument("--conversations", type=int, default=8, help="multi-turn: C conversations")
    w.add_argument("--turns", type=int, default=4, help="multi-turn: T turns each")
    w.add_argument("--agents", type=int, default=8, help="agent: concurrent agents")
    w.add_argument("--calls", type=int, default=8, help="agent: calls per agent")
    w.add_argument("--tools-len", type=int, default=1024,
                   help="agent: tokens of the fixed tool description every call starts with")
    w.add_argument("--result-len", type=int, default=64,
                   help="agent: tokens of each tool result appended before the next call")
    w.add_argument("--trees", type=int, default=4, help="tree-of-thought: questions")
    w.add_argument("--branches", type=int, default=3, help="tree-of-thought: B branches per node")
    w.add_argument("--depth", type=int, default=2, help="tree-of-thought: D levels")
    w.add_argument("--branch-len", type=int, default=16,
                   help="tree-of-thought: tokens of each branch's own instruction")
    w.add_argument("--no-shuffle", action="store_true",
                   help="shared-prefix: submit groups in order instead of shuffled")
    w.add_argument(*seed_flags, dest="bench_seed", type=int, default=0,
                   help="seed of the workload (prompts, lengths, arrival times)")


def workload_from_args(ns: argparse.Namespace, vocab: int, tokenizer: Any = None) -> Workload:
    seed = ns.bench_seed
    if ns.workload in TEXT_WORKLOADS:
        if tokenizer is None:
            raise ValueError(f"the {ns.workload} workload is text: it needs the model's tokenizer")
        from banyan.bench.grounded import chat_workload, grounded_workload

        build = grounded_workload if ns.workload == "grounded" else chat_workload
        return build(tokenizer, ns.num_requests, ns.output_len)
    if ns.workload == "random":
        return random_workload(ns.num_requests, ns.input_len, ns.output_len, vocab,
                               ns.range_ratio, seed)
    if ns.workload == "shared-prefix":
        return shared_prefix_workload(ns.groups, ns.prompts_per_group, ns.system_len,
                                      ns.question_len, ns.output_len, vocab, seed,
                                      shuffle=not ns.no_shuffle)
    if ns.workload == "multi-turn":
        return multi_turn_workload(ns.conversations, ns.turns, ns.system_len, ns.question_len,
                                   ns.output_len, vocab, seed)
    if ns.workload == "agent":
        return agent_workload(ns.agents, ns.calls, ns.tools_len, ns.question_len,
                              ns.result_len, ns.output_len, vocab, seed)
    if ns.workload == "tree-of-thought":
        return tree_of_thought_workload(ns.trees, ns.branches, ns.depth, ns.question_len,
                                        ns.branch_len, ns.output_len, vocab, seed)
    raise ValueError(f"unknown workload {ns.workload!r}")


def workload_vocab(tokenizer: object | None, model_vocab: int | None = None) -> int:
    """Prompt ids are drawn below this: the tokenizer's base vocabulary (added tokens excluded),
    and never past the model's embedding table."""
    sizes = [v for v in (getattr(tokenizer, "vocab_size", None), model_vocab) if v]
    if not sizes:
        raise ValueError("cannot tell the vocabulary size")
    return min(sizes)
