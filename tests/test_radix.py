"""RadixCache: exact unit cases, then a state machine against a naive model of cached prefixes."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

from banyan.cache import IntegrityError, RadixCache, check_integrity
from banyan.cache.radix import RadixNode
from banyan.mem.allocator import SlotAllocator


class RecordingAllocator(SlotAllocator):
    """Remembers each `free` call, so tests can assert which slots eviction freed, in order."""

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self.freed: list[list[int]] = []

    def free(self, slots: Iterable[int]) -> None:
        slots = list(slots)
        self.freed.append(slots)
        super().free(slots)


def make(num_slots: int = 64, page_size: int = 1) -> tuple[RecordingAllocator, RadixCache]:
    alloc = RecordingAllocator(num_slots)
    return alloc, RadixCache(alloc, page_size=page_size)


def put(cache: RadixCache, alloc: SlotAllocator, tokens: list[int], ns: str | None = None) -> Any:
    """A finished request's release: fresh slots offered, duplicates and tail freed."""
    slots = alloc.alloc(len(tokens))
    assert slots is not None
    res = cache.insert(tokens, slots, ns)
    alloc.free(slots[: res.cached_len] + slots[cache.aligned_len(len(tokens)) :])
    return res


# ---- exact unit cases ------------------------------------------------------------------------


def test_split_on_partial_match() -> None:
    alloc, cache = make()
    res = cache.insert([1, 2, 3, 4, 5], [11, 12, 13, 14, 15])
    assert res.cached_len == 0
    leaf = res.handle
    leaf_time = leaf.last_access
    m = cache.match_prefix([1, 2, 3, 9])
    assert m.slots == [11, 12, 13]
    head = m.handle
    assert isinstance(head, RadixNode)
    assert (head.key, head.slots) == ([1, 2, 3], [11, 12, 13])
    assert list(head.children.values()) == [leaf]
    assert (leaf.key, leaf.slots, leaf.parent) == ([4, 5], [14, 15], head)
    assert leaf.last_access == leaf_time  # the untouched suffix keeps its access time
    assert head.last_access > leaf_time
    assert cache.num_nodes == 2
    # The old handle still denotes the whole sequence.
    cache.lock(leaf)
    assert (cache.protected_size, cache.evictable_size) == (5, 0)
    cache.unlock(leaf)
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).slots == [11, 12, 13, 14, 15]
    cache.check_invariants()


def test_insert_reports_duplicates_and_keeps_first_slots() -> None:
    _, cache = make()
    assert cache.insert([1, 2, 3], [5, 6, 7]).cached_len == 0
    res = cache.insert([1, 2, 3, 4, 5], [20, 21, 22, 23, 24])
    assert res.cached_len == 3  # caller frees 20, 21, 22; the tree took 23, 24
    assert cache.match_prefix([1, 2, 3, 4, 5]).slots == [5, 6, 7, 23, 24]
    again = cache.insert([1, 2, 3, 4, 5], [30, 31, 32, 33, 34])
    assert again.cached_len == 5 and again.handle is res.handle
    diverge = cache.insert([1, 2, 9], [40, 41, 42])  # splits [1, 2, 3] at 2
    assert diverge.cached_len == 2
    assert sorted(cache.cached_slots()) == [5, 6, 7, 23, 24, 42]
    assert cache.evictable_size == 6 and cache.protected_size == 0
    with pytest.raises(ValueError):
        cache.insert([1, 2], [1])
    cache.check_invariants()


def test_lru_eviction_order_exact() -> None:
    alloc, cache = make()
    cache.insert([1, 2], [11, 12])  # t1
    cache.insert([3, 4], [13, 14])  # t2
    cache.insert([5, 6], [15, 16])  # t3
    cache.match_prefix([1, 2, 7])  # A is now the most recent
    assert cache.evict(1) == 2  # whole leaves: at least 1, here 2
    assert alloc.freed == [[13, 14]]
    assert cache.evict(100) == 4
    assert alloc.freed == [[13, 14], [15, 16], [11, 12]]
    assert cache.cached_slots() == [] and cache.evictable_size == 0
    assert cache.evict(5) == 0


def test_eviction_of_split_leaf_and_parent_becoming_leaf() -> None:
    alloc, cache = make()
    cache.insert([1, 2, 3, 4], [11, 12, 13, 14])  # t1
    cache.insert([7], [17])  # t2
    cache.match_prefix([1, 2])  # t3: splits into [1, 2] (t3) and [3, 4] (still t1)
    cache.insert([1, 2, 5], [11, 12, 15])  # t4: [1, 2] gets a second child [5]
    assert cache.evict(1) == 2
    assert alloc.freed == [[13, 14]]
    assert cache.evict(2) == 2  # [7] (t2), then [5] (t4); [1, 2] was bumped to t4 too
    assert alloc.freed == [[13, 14], [17], [15]]
    assert cache.evict(1) == 2  # the parent joined the candidates when it became a leaf
    assert alloc.freed[-1] == [11, 12]
    cache.check_invariants()


def test_locked_nodes_survive_eviction_and_sizes_move() -> None:
    alloc, cache = make()
    a = cache.insert([1, 2, 3], [11, 12, 13]).handle
    cache.insert([1, 2, 4, 5], [11, 12, 14, 15])
    cache.lock(a)
    assert (cache.protected_size, cache.evictable_size) == (3, 2)
    cache.lock(a)
    assert cache.evict(100) == 2
    assert alloc.freed == [[14, 15]]
    assert sorted(cache.cached_slots()) == [11, 12, 13]
    cache.unlock(a)
    assert (cache.protected_size, cache.evictable_size) == (3, 0)
    cache.unlock(a)
    assert (cache.protected_size, cache.evictable_size) == (0, 3)
    with pytest.raises(ValueError):
        cache.unlock(a)
    assert cache.evict(100) == 3  # [3] (split off when [1, 2, 4, 5] came), then [1, 2]
    assert alloc.freed[-2:] == [[13], [11, 12]]
    with pytest.raises(ValueError):
        cache.lock(a)  # evicted: locking it would protect nothing
    cache.lock(None)  # the no-cache handle is accepted
    cache.check_invariants()


def test_shared_len_is_the_prefix_another_lock_holds() -> None:
    """What the decode lane bounds attention's prefix search with: the part of a handle's
    path that another lock also passes through."""
    _, cache = make()
    a = cache.insert([1, 2, 3, 4], [11, 12, 13, 14]).handle
    b = cache.insert([1, 2, 3, 5, 6], [11, 12, 13, 15, 16]).handle  # splits after [1, 2, 3]
    c = cache.insert([7, 8], [17, 18]).handle
    cache.lock(a)
    assert cache.shared_len(a) == 0  # alone on its path
    cache.lock(b)
    assert (cache.shared_len(a), cache.shared_len(b)) == (3, 3)
    cache.lock(c)
    assert cache.shared_len(c) == 0
    cache.lock(a)  # a second holder of the same node: the whole path is shared
    assert (cache.shared_len(a), cache.shared_len(b)) == (4, 3)
    cache.unlock(a)
    cache.unlock(b)
    assert cache.shared_len(a) == 0
    assert cache.shared_len(None) == 0


def test_split_of_a_locked_node_keeps_it_locked() -> None:
    alloc, cache = make()
    leaf = cache.insert([1, 2, 3, 4], [11, 12, 13, 14]).handle
    cache.lock(leaf)
    head = cache.match_prefix([1, 2, 9]).handle
    assert head.lock == 1 and (cache.protected_size, cache.evictable_size) == (4, 0)
    assert cache.evict(100) == 0
    cache.unlock(leaf)
    assert head.lock == 0 and cache.evictable_size == 4
    assert cache.evict(100) == 4
    assert alloc.freed == [[13, 14], [11, 12]]


def test_page_alignment() -> None:
    alloc, cache = make(page_size=4)
    toks = list(range(100, 110))
    slots = list(range(1, 11))
    res = cache.insert(toks, slots)
    assert res.cached_len == 0
    assert sorted(cache.cached_slots()) == slots[:8]  # slots[8:] stay the caller's
    assert cache.evictable_size == 8
    assert cache.match_prefix(toks[:7]).slots == slots[:4]
    assert cache.match_prefix(toks).slots == slots[:8]
    m = cache.match_prefix(toks[:6] + [0, 0, 0, 0])  # diverges inside the second page
    assert m.slots == slots[:4] and m.query_len == 8 and m.miss_cause == "unseen"
    # Sharing 6 tokens shares one page; the second page is a new node under the split.
    other = cache.insert(toks[:6] + [1, 1], [21, 22, 23, 24, 25, 26, 27, 28])
    assert other.cached_len == 4
    assert other.handle.slots == [25, 26, 27, 28] and other.handle.parent.key == toks[:4]
    short = cache.insert([1, 2, 3], [31, 32, 33])  # no whole page: nothing taken
    assert short.cached_len == 0 and short.handle.is_root
    cache.lock(short.handle)  # a root handle locks nothing
    assert cache.protected_size == 0
    assert cache.match_prefix([100, 101, 102]).slots == []
    cache.check_invariants()


def test_long_keys_compare_in_chunks() -> None:
    for page in (1, 4):
        _, cache = make(num_slots=512, page_size=page)
        toks = list(range(300))
        cache.insert(toks, list(range(1, 301)))
        probe = toks[:130] + [-1] * 50
        assert len(cache.match_prefix(probe).slots) == 130 - 130 % page
        cache.check_invariants()


def test_namespaces_isolate() -> None:
    alloc, cache = make()
    cache.insert([1, 2, 3], [11, 12, 13], "a")
    assert cache.match_prefix([1, 2, 3]).slots == []
    assert cache.match_prefix([1, 2, 3], "b").slots == []
    assert cache.match_prefix([1, 2, 3], "a").slots == [11, 12, 13]
    assert cache.insert([1, 2, 3], [21, 22, 23], "b").cached_len == 0
    assert cache.match_prefix([1, 2, 3], "b").slots == [21, 22, 23]
    assert cache.evict(100) == 6
    assert cache._roots == {}  # emptied namespaces leave nothing behind
    cache.check_invariants()


def test_flush_refuses_while_locked() -> None:
    alloc, cache = make()
    put(cache, alloc, [1, 2, 3])
    h = put(cache, alloc, [4, 5], "x").handle
    before = sorted(cache.cached_slots())
    cache.lock(h)
    assert cache.flush() is False
    assert sorted(cache.cached_slots()) == before and alloc.num_free == alloc.capacity - 5
    cache.unlock(h)
    assert cache.flush() is True
    assert cache.cached_slots() == [] and cache.evictable_size == cache.protected_size == 0
    assert alloc.num_free == alloc.capacity
    assert cache.match_prefix([1, 2, 3]).slots == []
    check_integrity(alloc, cache, [])


def test_miss_cause_and_stats() -> None:
    alloc, cache = make()
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [1, 2, 3, 4, 5])
    put(cache, alloc, [9, 9], "t")
    hot = cache.match_prefix([1, 2, 3]).handle  # a shared prefix stays; its tail is evicted
    cache.lock(hot)
    assert cache.evict(100) == 4
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).miss_cause == "evicted"
    assert cache.match_prefix([1, 2, 3, 4, 9]).miss_cause == "unseen"  # only the 4 agrees
    assert cache.match_prefix([1, 2, 3]).miss_cause == "none"
    cache.unlock(hot)
    cache.evict(100)
    assert cache.stats.evicted_tokens == 7
    assert cache.match_prefix([1, 2], count_stats=False).miss_cause == "evicted"
    assert cache.match_prefix([1, 7]).miss_cause == "unseen"
    assert cache.match_prefix([9, 9], "t").miss_cause == "evicted"  # its root was pruned
    assert cache.match_prefix([9, 9], "u").miss_cause == "unseen"
    s = cache.stats
    assert (s.matches, s.query_tokens, s.hit_tokens, s.evicted_misses) == (7, 23, 12, 2)
    assert s.hit_rate == pytest.approx(12 / 23)


def test_heap_stays_bounded_under_lock_cycles() -> None:
    alloc, cache = make()
    put(cache, alloc, [1, 2, 3])
    for _ in range(1000):
        m = cache.match_prefix([1, 2, 3])
        cache.lock(m.handle)
        cache.unlock(m.handle)
    assert len(cache._heap) <= 2 * cache.num_nodes + 65
    assert cache.evict(1) == 3


def test_integrity_catches_leaks_and_doubles() -> None:
    alloc, cache = make(num_slots=8)
    slots = alloc.alloc(3)
    assert slots is not None
    cache.insert([1, 2, 3], slots)
    check_integrity(alloc, cache, [])
    with pytest.raises(IntegrityError, match="two places"):
        check_integrity(alloc, cache, [slots[0]])
    held = alloc.alloc(2)
    with pytest.raises(IntegrityError, match="leaked"):
        check_integrity(alloc, cache, held[:1])
