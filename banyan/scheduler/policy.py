"""Cache-aware ordering of the waiting queue.

- fcfs: arrival order (retracted requests first: they had been admitted before the rest).
- lpm: longest cached prefix first, so requests that will hit the cache run while their prefix
  is still there (and before other traffic evicts it).
- dfs-weight: walk the radix tree depth-first, heavier subtrees (more waiting requests) first, so
  requests sharing a prefix run back to back.

Both cache-aware policies fall back to fcfs when the queue is longer than `fcfs_threshold`:
matching every waiting request every step costs more than it saves.

In-batch prefix sharing: a request that shares a long uncached prefix with a request placed
before it in this step's order, or with a running request still computing its prompt, is
deferred to a later step, by when the first one has computed (and cached) the shared part.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from banyan.cache.base import PrefixCache
from banyan.mem.allocator import SlotAllocator
from banyan.scheduler.queue import WaitingQueue
from banyan.scheduler.request import Request

POLICIES = ("lpm", "dfs-weight", "fcfs")


@dataclass(slots=True)
class PolicyConfig:
    name: str = "lpm"
    fcfs_threshold: int = 128
    # Defer a request that shares at least this many uncached tokens with one admitted earlier
    # in the step or still prefilling.
    in_batch_threshold: int = 32


class SchedulePolicy:
    def __init__(self, config: PolicyConfig, cache: PrefixCache) -> None:
        if config.name not in POLICIES:
            raise ValueError(f"schedule_policy must be one of {POLICIES}, got {config.name!r}")
        self.config = config
        self.cache = cache
        self.cache_aware = config.name != "fcfs" and cache.keeps_prefixes

    def order(self, waiting: WaitingQueue, prefilling: list[Request]) -> list[Request]:
        """Candidates for admission this step, best first; deferred requests are left out.
        prefilling: running requests whose prompt was not all in KV when the step began (their
        chunks this step are not in the cache yet)."""
        reqs = list(waiting)
        if not self.cache_aware or len(reqs) > self.config.fcfs_threshold:
            return reqs
        if len(reqs) + len(prefilling) < 2:
            return reqs  # nothing to order, nobody to share with
        matches = {}
        nodes = {}
        for req in reqs:
            result = self.cache.match_prefix(req.token_ids(0, req.num_tokens - 1), req.namespace,
                                             count_stats=False)
            matches[req] = len(result.slots)
            nodes[req] = result.handle
        if self.config.name == "lpm":
            reqs.sort(key=lambda r: -matches[r])  # stable: arrival order among equals
        else:
            reqs = _dfs_weight_order(reqs, nodes)
        return self._without_in_batch_followers(reqs, matches, prefilling)

    def _without_in_batch_followers(self, reqs: list[Request], matches: dict[Request, int],
                                    prefilling: list[Request]) -> list[Request]:
        from banyan.cache.radix import RadixCache

        threshold = self.config.in_batch_threshold
        # Prompts being computed now (running, or admitted earlier in this order), by key only:
        # the "slots" stored are dummies.
        computing = RadixCache(SlotAllocator(2))
        for req in prefilling:
            tokens = req.token_ids(0, req.num_tokens - 1)
            computing.insert(tokens, tokens, req.namespace)
        kept: list[Request] = []
        for req in reqs:
            tokens = req.token_ids(0, req.num_tokens - 1)
            shared = len(computing.match_prefix(tokens, req.namespace, count_stats=False).slots)
            if shared - matches[req] >= threshold and (kept or prefilling):
                continue  # it will find those tokens in the cache in a step or two
            computing.insert(tokens, tokens, req.namespace)
            kept.append(req)
        return kept


def _dfs_weight_order(reqs: list[Request], nodes: dict[Request, Any]) -> list[Request]:
    """Requests grouped under their deepest matched tree node; subtrees with more waiting
    requests first, and deeper matches before the requests waiting at an ancestor."""
    at_node: dict[Any, list[Request]] = defaultdict(list)
    weight: dict[Any, int] = defaultdict(int)
    children: dict[Any, list[Any]] = defaultdict(list)
    roots: list[Any] = []
    for req in reqs:
        node = nodes[req]
        at_node[node].append(req)
        while node is not None:
            if weight[node] == 0:
                parent = getattr(node, "parent", None)
                (children[parent] if parent is not None else roots).append(node)
            weight[node] += 1
            node = getattr(node, "parent", None)
    ordered: list[Request] = []
    # Iterative post-order (prefix trees can be deeper than Python's recursion limit).
    stack = [(n, False) for n in sorted(roots, key=lambda n: weight[n])]  # heaviest on top
    while stack:
        node, expanded = stack.pop()
        if expanded:
            ordered.extend(at_node.get(node, ()))
            continue
        stack.append((node, True))
        stack.extend((c, False) for c in sorted(children.get(node, ()), key=lambda n: weight[n]))
    return ordered
