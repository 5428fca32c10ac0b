"""Routing policies: given a request's key and the workers that may take it, pick one.

Policies see workers as `Candidate` snapshots (no I/O, no clocks of their own but the tree's), so
their decisions are exact functions of their inputs and are unit-tested without processes.

Load = in-flight requests (counted by the router) + kv_load_weight x KV usage (scraped from the
worker's metrics): the request count alone misses a worker whose few requests fill its KV cache.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from banyan.router.args import RouterArgs
from banyan.router.keys import RouteKey
from banyan.router.tree import ApproxTree


@dataclass(slots=True, frozen=True)
class Candidate:
    url: str
    in_flight: int = 0
    kv_usage: float | None = None  # 0..1; None until the worker's metrics were read
    routed: int = 0  # requests routed there so far: the last tie-breaker, spreads idle traffic


@dataclass(slots=True, frozen=True)
class Decision:
    url: str
    # cache_hit | cache_miss | imbalance (cache_aware), or the policy's name for the others
    outcome: str
    matched: int = 0  # key symbols the chosen worker's tree matched (cache_aware)
    key_len: int = 0


def load(c: Candidate, kv_weight: float) -> float:
    return c.in_flight + kv_weight * (c.kv_usage or 0.0)


# Loads closer than this to the lowest count as equal. Below one request, so the in-flight count
# always decides; the KV usage term (read at the last health check, up to seconds old) then
# decides only when it is large, and does not override the tie-breakers with noise.
LOAD_TIE = 0.5


# On a cache miss, loads within this fraction of the lowest also count as equal, so the tree
# sizes decide: a new prefix group brings all its later requests with it, and a worker holding
# fewer groups will get less of the coming traffic, which a momentary difference of a request
# or two in flight does not show (measured: 16 groups over 2 workers split 9/7 by in-flight
# alone, and the 9-group worker set the run's length).
MISS_LOAD_BAND = 0.5


def least_loaded(candidates: Sequence[Candidate], kv_weight: float,
                 tie: Callable[[Candidate], float] = lambda c: 0.0,
                 band: float = 0.0) -> Candidate:
    """Lowest load (within LOAD_TIE, or `band` x the lowest load when larger); ties go to the
    lower `tie`, then to the worker routed to least so far (so sequential requests to idle
    workers spread instead of all landing on the first one)."""
    loads = [load(c, kv_weight) for c in candidates]
    floor = min(loads) + max(LOAD_TIE, band * min(loads))
    near = [(x, c) for x, c in zip(loads, candidates, strict=True) if x <= floor]
    return min(near, key=lambda xc: (tie(xc[1]), xc[1].routed, xc[0]))[1]


class Policy:
    name = "policy"

    def choose(self, key: RouteKey | None, candidates: Sequence[Candidate]) -> Decision:
        raise NotImplementedError

    def forget(self, url: str) -> None:
        """The worker is gone or failed: drop what is remembered about it."""

    def flush(self) -> None:
        """The workers' caches were flushed."""

    def maintain(self) -> None:
        """Periodic housekeeping (tree eviction)."""

    def tree_sizes(self) -> dict[str, int]:
        return {}


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, key: RouteKey | None, candidates: Sequence[Candidate]) -> Decision:
        c = candidates[self._next % len(candidates)]
        self._next += 1
        return Decision(c.url, self.name)


class RandomChoice(Policy):
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, key: RouteKey | None, candidates: Sequence[Candidate]) -> Decision:
        return Decision(self._rng.choice(list(candidates)).url, self.name)


class ShortestQueue(Policy):
    name = "shortest_queue"

    def __init__(self, kv_weight: float) -> None:
        self.kv_weight = kv_weight

    def choose(self, key: RouteKey | None, candidates: Sequence[Candidate]) -> Decision:
        return Decision(least_loaded(candidates, self.kv_weight).url, self.name)


class CacheAware(Policy):
    """SGLang's router rule, with the miss path fixed to go by load:
    1. load imbalanced (max - min > abs AND max > rel x min): the least-loaded worker;
    2. else the worker whose tree matches the longest prefix, if the match covers more than
       `cache_threshold` of the key;
    3. else the least-loaded worker, the smaller tree breaking ties, loads within
       MISS_LOAD_BAND of the lowest counting as tied. (Sending every miss to the smallest tree
       regardless of load piles new prefixes onto one worker.)
    The key is then recorded under the chosen worker, whatever the reason it was chosen."""

    name = "cache_aware"

    def __init__(self, cache_threshold: float, balance_abs: float, balance_rel: float,
                 kv_weight: float, max_tree_size: int, tree: ApproxTree | None = None) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.kv_weight = kv_weight
        self.max_tree_size = max_tree_size
        self.tree = tree if tree is not None else ApproxTree()

    def imbalanced(self, candidates: Sequence[Candidate]) -> bool:
        loads = [load(c, self.kv_weight) for c in candidates]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs and hi > self.balance_rel * lo

    def choose(self, key: RouteKey | None, candidates: Sequence[Candidate]) -> Decision:
        def by_tree(c: Candidate) -> float:
            return self.tree.size(c.url)

        if key is None:
            c = least_loaded(candidates, self.kv_weight, by_tree)
            return Decision(c.url, "cache_miss")
        match = self.tree.match(key.text, key.namespace)
        if len(candidates) > 1 and self.imbalanced(candidates):
            url, outcome = least_loaded(candidates, self.kv_weight, by_tree).url, "imbalance"
        else:
            best = max(candidates, key=lambda c: (match.length(c.url),
                                                  -load(c, self.kv_weight), -c.routed))
            if match.length(best.url) > self.cache_threshold * len(key):
                url, outcome = best.url, "cache_hit"
            else:
                url = least_loaded(candidates, self.kv_weight, by_tree, MISS_LOAD_BAND).url
                outcome = "cache_miss"
        self.tree.insert(key.text, url, key.namespace)
        return Decision(url, outcome, match.length(url), len(key))

    def forget(self, url: str) -> None:
        self.tree.remove_tenant(url)

    def flush(self) -> None:
        self.tree = ApproxTree()

    def maintain(self) -> None:
        self.tree.evict(self.max_tree_size)

    def tree_sizes(self) -> dict[str, int]:
        return self.tree.sizes()


def make_policy(args: RouterArgs) -> Policy:
    if args.policy == "cache_aware":
        return CacheAware(args.cache_threshold, args.balance_abs_threshold,
                          args.balance_rel_threshold, args.kv_load_weight, args.max_tree_size)
    if args.policy == "round_robin":
        return RoundRobin()
    if args.policy == "shortest_queue":
        return ShortestQueue(args.kv_load_weight)
    if args.policy == "random":
        return RandomChoice()
    raise ValueError(f"unknown policy {args.policy!r}")
