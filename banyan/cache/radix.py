"""RadixAttention's prefix tree: token-id prefixes -> KV slots, with locks and LRU eviction.

Pure Python, knows slot indices only. One tree per namespace (the request's `cache_salt`), so
tenants never share KV. Every node's key and slots have the same length, a non-zero multiple of
`page_size`.

Page alignment (page_size p > 1): only whole pages are ever matched or cached. For tokens of
length n, let `aligned = n // p * p` (`RadixCache.aligned_len(n)`).
- `match_prefix(tokens)` returns slots for at most `aligned` tokens, always a multiple of p.
- `insert(tokens, slots)` considers only `tokens[:aligned]`: `cached_len <= aligned` is the
  page-aligned length already in the tree; the tree takes `slots[cached_len:aligned]`; the caller
  keeps `slots[aligned:]` (a partial trailing page is never shared) and frees its own duplicates
  among `slots[:cached_len]`, exactly as with p == 1 (where `aligned == n`).

Eviction candidates are unlocked leaves in a min-heap on (last access, sequence number) with lazy
deletion: an entry is acted on only if its node is still an unlocked leaf in the tree with the
same access time; every change that makes a node an unlocked leaf, or re-times one, pushes an
entry, and the heap is compacted when stale entries outnumber the nodes.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from banyan.cache.base import InsertResult, MatchResult, PrefixCache
from banyan.mem.allocator import SlotAllocator

#: Why a match stopped short: "none" (every aligned token matched); "evicted" (the node where the
#: match stopped once had a child, since evicted, whose leading tokens agree with the query: a hint,
#: recalled for the last `evicted_memory` evictions, and only while that node survives); "unseen"
#: (anything else: never cached, forgotten, or its parent was evicted and re-created too).
MissCause = Literal["none", "evicted", "unseen"]

# A miss counts as "evicted" when the query agrees with this many leading tokens of the evicted
# leaf's key (or all of them): enough to tell prompts apart that share only a first token.
_EVICTED_HEAD_TOKENS = 32

# Compare keys this many tokens at a time with C-level list equality before a per-token scan.
_SCAN_CHUNK = 64


@dataclass(slots=True, eq=False)
class RadixNode:
    key: list[int]
    slots: list[int]
    parent: RadixNode | None
    uid: int
    children: dict[Hashable, RadixNode] = field(default_factory=dict)
    lock: int = 0  # locked handles at or below this node
    last_access: int = 0
    removed: bool = False  # evicted or flushed: a handle to it must not be locked again
    is_root: bool = False
    namespace: str | None = None  # roots only


@dataclass(slots=True)
class RadixMatchResult(MatchResult):
    query_len: int  # page-aligned length of the query: len(slots) == query_len means a full hit
    miss_cause: MissCause


@dataclass(slots=True)
class RadixStats:
    """Cumulative counters; tokens are page-aligned."""

    matches: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    inserted_tokens: int = 0  # tokens the tree took ownership of
    evicted_tokens: int = 0
    evicted_misses: int = 0  # matches that stopped at a page the tree had evicted

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class RadixCache(PrefixCache):
    def __init__(
        self, allocator: SlotAllocator, page_size: int = 1, evicted_memory: int = 4096
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.stats = RadixStats()
        self._evicted_memory = evicted_memory
        # (anchor of the parent, child key) -> first tokens of a recently evicted leaf: tells
        # "evicted" from "unseen" for a miss at a node that survived, without keeping whole keys.
        self._evicted: OrderedDict[tuple[Hashable, Hashable], list[int]] = OrderedDict()
        self._uids = itertools.count(1)
        self._seq = itertools.count()
        self._roots: dict[str | None, RadixNode] = {}
        # Handle for matches in a namespace that has no tree: locking a root is a no-op.
        self._empty_root = self._new_root(None)
        self._heap: list[tuple[int, int, RadixNode]] = []
        self._clock = 0
        self._num_nodes = 0  # non-root nodes in the tree
        self._evictable = 0
        self._protected = 0

    # ---- PrefixCache -------------------------------------------------------------------------

    @property
    def evictable_size(self) -> int:
        return self._evictable

    @property
    def protected_size(self) -> int:
        return self._protected

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    def aligned_len(self, n: int) -> int:
        return n - n % self.page_size

    def match_prefix(
        self, tokens: Sequence[int], namespace: str | None = None, *, count_stats: bool = True
    ) -> RadixMatchResult:
        """Longest cached page-aligned prefix of `tokens`. A match ending inside a node splits it,
        so the handle is exactly the last matched node. Pass `count_stats=False` for a re-match
        that is not a new query (e.g. after inserting a prefill chunk)."""
        toks = tokens if isinstance(tokens, list) else list(tokens)
        n = self.aligned_len(len(toks))
        self._clock += 1
        now = self._clock
        node = self._roots.get(namespace, self._empty_root)
        slots: list[int] = []
        i = 0
        stopped_inside = False
        while i < n:
            child = node.children.get(self._child_key(toks, i))
            if child is None:
                break
            common = self._common_len(child.key, toks, i, n)
            if common < len(child.key):
                child = self._split(child, common)
                stopped_inside = True
            child.last_access = now
            slots.extend(child.slots)
            node = child
            i += common
            if stopped_inside:
                break
        self._touched(node)

        cause: MissCause = "none"
        if i < n:
            cause = "unseen"
            if not stopped_inside:
                # `node` may be the shared empty root: key by the queried namespace.
                anchor = ("ns", namespace) if node.is_root else node.uid
                head = self._evicted.get((anchor, self._child_key(toks, i)))
                end = n if head is None else min(n, i + len(head))
                if head is not None and head[: end - i] == toks[i:end]:
                    cause = "evicted"
        if count_stats:
            self.stats.matches += 1
            self.stats.query_tokens += n
            self.stats.hit_tokens += i
            self.stats.evicted_misses += cause == "evicted"
        return RadixMatchResult(slots=slots, handle=node, query_len=n, miss_cause=cause)

    def insert(
        self, tokens: Sequence[int], slots: Sequence[int], namespace: str | None = None
    ) -> InsertResult:
        """Cache `tokens[:aligned]`. Returns the already-cached aligned length and the node that
        ends at `aligned` (a root, whose lock is a no-op, when `aligned == 0`)."""
        if len(slots) != len(tokens):
            raise ValueError(f"insert: {len(tokens)} tokens but {len(slots)} slots")
        n = self.aligned_len(len(tokens))
        if n == 0:
            return InsertResult(cached_len=0, handle=self._roots.get(namespace, self._empty_root))
        toks = tokens if isinstance(tokens, list) else list(tokens)
        self._clock += 1
        now = self._clock
        node = self._roots.get(namespace)
        if node is None:
            node = self._roots[namespace] = self._new_root(namespace)
        i = 0
        while i < n:
            key = self._child_key(toks, i)
            child = node.children.get(key)
            if child is None:
                leaf = RadixNode(
                    key=toks[i:n], slots=list(slots[i:n]), parent=node, uid=next(self._uids),
                    last_access=now,
                )  # fmt: skip
                node.children[key] = leaf
                self._num_nodes += 1
                self._evictable += n - i
                self.stats.inserted_tokens += n - i
                self._push(leaf)
                return InsertResult(cached_len=i, handle=leaf)
            common = self._common_len(child.key, toks, i, n)
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access = now
            node = child
            i += common
        self._touched(node)
        return InsertResult(cached_len=n, handle=node)

    def lock(self, handle: Any) -> None:
        node = self._node(handle)
        if node is None:
            return
        while not node.is_root:
            if node.lock == 0:
                self._evictable -= len(node.slots)
                self._protected += len(node.slots)
            node.lock += 1
            node = node.parent  # type: ignore[assignment]  # non-roots have parents

    def shared_len(self, handle: Any) -> int | None:
        """The length of the handle's path up to the deepest node that another lock also
        passes through (a node's count includes every lock at or below it)."""
        node = self._node(handle)
        below = 0  # slots of the path's nodes under the deepest shared one
        while node is not None and not node.is_root and node.lock < 2:
            below += len(node.slots)
            node = node.parent
        if node is None or node.is_root:
            return 0
        total = below
        while not node.is_root:
            total += len(node.slots)
            node = node.parent  # type: ignore[assignment]  # non-roots have parents
        return total - below

    def unlock(self, handle: Any) -> None:
        start = self._node(handle)
        if start is None or start.is_root:
            return
        # An ancestor's count is at least its descendant's, so checking the handle suffices.
        if start.lock <= 0:
            raise ValueError("unlock of a node that is not locked")
        node = start
        while not node.is_root:
            node.lock -= 1
            if node.lock == 0:
                self._protected -= len(node.slots)
                self._evictable += len(node.slots)
            node = node.parent  # type: ignore[assignment]
        self._touched(start)

    def evict(self, num_slots: int) -> int:
        freed = 0
        while freed < num_slots and self._heap:
            access, _, node = heapq.heappop(self._heap)
            if not self._is_candidate(node, access):
                continue
            parent = node.parent
            assert parent is not None
            del parent.children[self._child_key(node.key, 0)]
            node.removed = True
            self.allocator.free(node.slots)
            freed += len(node.slots)
            self._evictable -= len(node.slots)
            self._num_nodes -= 1
            self.stats.evicted_tokens += len(node.slots)
            self._remember_evicted(parent, node)
            if parent.is_root:
                if not parent.children and self._roots.get(parent.namespace) is parent:
                    del self._roots[parent.namespace]  # unbounded salts must not pile up roots
            elif not parent.children and parent.lock == 0:
                self._push(parent)
        return freed

    def flush(self) -> bool:
        # Every non-root node holds >= 1 slot, so no protected slot means no locked node.
        if self._protected:
            return False
        for root in self._roots.values():
            for node in self._walk(root):
                node.removed = True
                self.allocator.free(node.slots)
        self._roots.clear()
        self._heap.clear()
        self._evicted.clear()
        self._num_nodes = 0
        self._evictable = 0
        return True

    def cached_slots(self) -> list[int]:
        return [s for root in self._roots.values() for n in self._walk(root) for s in n.slots]

    # ---- internals ---------------------------------------------------------------------------

    def _new_root(self, namespace: str | None) -> RadixNode:
        return RadixNode(
            key=[], slots=[], parent=None, uid=next(self._uids), is_root=True, namespace=namespace
        )

    def _child_key(self, toks: list[int], i: int) -> Hashable:
        if self.page_size == 1:
            return toks[i]
        return tuple(toks[i : i + self.page_size])

    def _common_len(self, key: list[int], toks: list[int], start: int, end: int) -> int:
        """Page-aligned length of the common prefix of `key` and `toks[start:end]`."""
        n = min(len(key), end - start)  # aligned: keys, `start` and `end` all are
        if key[:n] == toks[start : start + n]:
            return n
        i = 0
        step = _SCAN_CHUNK
        while i + step <= n and key[i : i + step] == toks[start + i : start + i + step]:
            i += step
        while i < n and key[i] == toks[start + i]:
            i += 1
        return i - i % self.page_size

    def _split(self, child: RadixNode, at: int) -> RadixNode:
        """Split `child` at `at` (0 < at < len): a new node takes the prefix; `child` keeps the
        suffix and its identity, so handles to it, its heap entry and access time stay valid."""
        parent = child.parent
        assert parent is not None and 0 < at < len(child.key)
        head = RadixNode(
            key=child.key[:at], slots=child.slots[:at], parent=parent, uid=next(self._uids),
            lock=child.lock, last_access=child.last_access,
        )  # fmt: skip
        parent.children[self._child_key(child.key, 0)] = head
        child.key = child.key[at:]
        child.slots = child.slots[at:]
        child.parent = head
        head.children[self._child_key(child.key, 0)] = child
        self._num_nodes += 1
        return head

    def _node(self, handle: Any) -> RadixNode | None:
        if handle is None:
            return None
        if not isinstance(handle, RadixNode):
            raise TypeError(f"not a RadixCache handle: {handle!r}")
        if handle.removed:
            raise ValueError("handle refers to an evicted or flushed node")
        return handle

    def _anchor(self, node: RadixNode) -> Hashable:
        # Roots come and go with their namespace; key them by name so a recreated one still
        # recalls what was evicted under it.
        return ("ns", node.namespace) if node.is_root else node.uid

    def _remember_evicted(self, parent: RadixNode, node: RadixNode) -> None:
        if self._evicted_memory <= 0:
            return
        entry = (self._anchor(parent), self._child_key(node.key, 0))
        self._evicted[entry] = node.key[:_EVICTED_HEAD_TOKENS]
        self._evicted.move_to_end(entry)
        if len(self._evicted) > self._evicted_memory:
            self._evicted.popitem(last=False)

    def _is_candidate(self, node: RadixNode, access: int) -> bool:
        return (
            not node.removed
            and not node.children
            and node.lock == 0
            and not node.is_root
            and node.last_access == access
        )

    def _touched(self, node: RadixNode) -> None:
        """Call after a node's access time or lock changed: an unlocked leaf needs a fresh entry."""
        if not node.is_root and node.lock == 0 and not node.children:
            self._push(node)

    def _push(self, node: RadixNode) -> None:
        heapq.heappush(self._heap, (node.last_access, next(self._seq), node))
        if len(self._heap) > 2 * self._num_nodes + 64:
            # A node re-pushed at an unchanged time is valid twice: keep one entry per node.
            live = {id(e[2]): e for e in self._heap if self._is_candidate(e[2], e[0])}
            self._heap = list(live.values())
            heapq.heapify(self._heap)

    @staticmethod
    def _walk(root: RadixNode) -> list[RadixNode]:
        """Every non-root node under `root` (iterative: deep chains must not hit recursion)."""
        out: list[RadixNode] = []
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def check_invariants(self) -> None:
        """O(tree) self-check for tests and debug runs; raises AssertionError on a violation."""
        live_entries = {id(e[2]) for e in self._heap if self._is_candidate(e[2], e[0])}
        evictable = protected = count = 0
        seen: set[int] = set()
        for ns, root in self._roots.items():
            assert root.is_root and root.namespace == ns and root.children, f"bad root {ns!r}"
            for node in self._walk(root):
                count += 1
                assert node.key and len(node.key) == len(node.slots), "key/slots mismatch"
                assert len(node.key) % self.page_size == 0, "key not page-aligned"
                assert not node.removed
                assert node.parent is not None
                assert node.parent.children.get(self._child_key(node.key, 0)) is node, "bad link"
                assert node.lock >= sum(c.lock for c in node.children.values()) >= 0, "lock count"
                assert seen.isdisjoint(node.slots), "a slot is cached twice"
                seen.update(node.slots)
                if node.lock:
                    protected += len(node.slots)
                else:
                    evictable += len(node.slots)
                    if not node.children:
                        assert id(node) in live_entries, "evictable leaf missing from the heap"
        assert count == self._num_nodes, f"num_nodes {self._num_nodes} != {count}"
        assert evictable == self._evictable, f"evictable {self._evictable} != {evictable}"
        assert protected == self._protected, f"protected {self._protected} != {protected}"
