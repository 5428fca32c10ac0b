"""The router's approximate radix tree: for every worker, the prompt prefixes it was sent, with
the time each was last sent there.

Approximate because it is built only from the router's own decisions: a worker may have evicted
a prefix, or hold prefixes it got from elsewhere; neither is known here. It is a hint that costs
nothing to be wrong about (the worker computes what it misses).

One tree for all workers (SGLang's router's layout): each node holds a piece of key text and, per
worker ("tenant") that was sent a key through this node, a last-access time. A tenant on a node
is on all its ancestors too (an insert marks the whole path), so one walk yields every worker's
match length. Keys are strings (see keys.py: text, or one character per token id) so edges are
compared with C-level `startswith`. Namespaces (text / ids / chat, cache salt) have separate roots.

Size is counted per tenant in key symbols on its nodes. `evict(max_size)` trims each tenant past
it, least recently used first, by removing the tenant from its own leaves (nodes where no child
has it); a node no tenant holds any more is dropped.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class _Node:
    edge: str
    parent: _Node | None
    children: dict[str, _Node] = field(default_factory=dict)  # first character -> child
    tenants: dict[str, float] = field(default_factory=dict)  # worker -> last access time


@dataclass(slots=True)
class TreeMatch:
    """Per worker, how many leading symbols of the key its part of the tree holds."""

    key_len: int
    lengths: dict[str, int]

    def length(self, tenant: str) -> int:
        return self.lengths.get(tenant, 0)


def _common_len(edge: str, key: str, pos: int) -> int:
    """Length of the common prefix of `edge` and `key[pos:]`; the first characters are known to
    be equal (the child was found by them)."""
    if key.startswith(edge, pos):
        return len(edge)
    lo, hi = 1, min(len(edge), len(key) - pos)  # edge[:lo] matches; find the largest such lo
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if key.startswith(edge[:mid], pos):
            lo = mid
        else:
            hi = mid - 1
    return lo


class ApproxTree:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._roots: dict[str, _Node] = {}
        self._sizes: dict[str, int] = {}
        self._clock = clock

    def size(self, tenant: str) -> int:
        return self._sizes.get(tenant, 0)

    def sizes(self) -> dict[str, int]:
        return dict(self._sizes)

    def match(self, key: str, namespace: str = "") -> TreeMatch:
        """Every tenant's matched length; read-only (the insert that follows a routing decision
        refreshes the chosen worker's times)."""
        lengths: dict[str, int] = {}
        node = self._roots.get(namespace)
        pos = 0
        while node is not None and pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            n = _common_len(child.edge, key, pos)
            pos += n
            for tenant in child.tenants:  # deeper nodes overwrite: the deepest wins
                lengths[tenant] = pos
            if n < len(child.edge):
                break
            node = child
        return TreeMatch(len(key), lengths)

    def insert(self, key: str, tenant: str, namespace: str = "") -> None:
        """Mark every prefix of `key` as sent to `tenant`, now."""
        if not key:
            return
        now = self._clock()
        node = self._roots.get(namespace)
        if node is None:
            node = self._roots[namespace] = _Node("", None)
        pos = 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                leaf = _Node(key[pos:], node, tenants={tenant: now})
                node.children[key[pos]] = leaf
                self._sizes[tenant] = self._sizes.get(tenant, 0) + len(leaf.edge)
                return
            n = _common_len(child.edge, key, pos)
            if n < len(child.edge):
                child = self._split(child, n)
            if tenant not in child.tenants:
                self._sizes[tenant] = self._sizes.get(tenant, 0) + len(child.edge)
            child.tenants[tenant] = now
            pos += n
            node = child

    @staticmethod
    def _split(child: _Node, n: int) -> _Node:
        """Cut `child`'s edge after n symbols; the new upper node takes the child's tenants (the
        tenant sizes do not change: the same symbols, on two nodes)."""
        parent = child.parent
        assert parent is not None
        upper = _Node(child.edge[:n], parent, tenants=dict(child.tenants))
        parent.children[child.edge[0]] = upper
        child.edge = child.edge[n:]
        child.parent = upper
        upper.children[child.edge[0]] = child
        return upper

    def _nodes(self) -> Iterator[_Node]:
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    @staticmethod
    def _is_leaf_of(node: _Node, tenant: str) -> bool:
        return tenant in node.tenants and not any(tenant in c.tenants
                                                  for c in node.children.values())

    def _drop(self, node: _Node, tenant: str) -> None:
        del node.tenants[tenant]
        self._sizes[tenant] -= len(node.edge)
        if not node.tenants and not node.children and node.parent is not None:
            del node.parent.children[node.edge[0]]

    def evict(self, max_size: int) -> int:
        """Trim every tenant to at most `max_size` symbols, oldest leaves first; returns the
        symbols removed. Walks the whole tree once: run it in the background, not per request."""
        over = {t for t, s in self._sizes.items() if s > max_size}
        if not over:
            return 0
        seq = itertools.count()
        heap: list[tuple[float, int, str, _Node]] = []
        for node in self._nodes():
            for tenant in over & node.tenants.keys():
                if self._is_leaf_of(node, tenant):
                    heap.append((node.tenants[tenant], next(seq), tenant, node))
        heapq.heapify(heap)
        removed = 0
        while heap:
            _, _, tenant, node = heapq.heappop(heap)
            if self._sizes[tenant] <= max_size or tenant not in node.tenants:
                continue
            removed += len(node.edge)
            self._drop(node, tenant)
            parent = node.parent
            if parent is not None and parent.parent is not None and \
                    self._is_leaf_of(parent, tenant):
                heapq.heappush(heap, (parent.tenants[tenant], next(seq), tenant, parent))
        for tenant in over:
            if self._sizes[tenant] == 0:
                del self._sizes[tenant]
        self._drop_empty_roots()
        return removed

    def remove_tenant(self, tenant: str) -> None:
        """Forget everything sent to `tenant` (a worker removed, or one that failed and may
        come back with an empty cache)."""
        if tenant not in self._sizes:
            return
        # Children before parents, so emptied parents see their emptied children gone.
        for node in reversed(list(self._nodes())):
            if tenant in node.tenants:
                self._drop(node, tenant)
        del self._sizes[tenant]
        self._drop_empty_roots()

    def _drop_empty_roots(self) -> None:
        for ns in [ns for ns, root in self._roots.items() if not root.children]:
            del self._roots[ns]
