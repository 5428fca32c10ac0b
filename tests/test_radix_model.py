"""RadixCache against a naive model: a hypothesis state machine playing the scheduler's steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from banyan.cache import RadixCache, check_integrity
from banyan.mem.allocator import SlotAllocator

# ---- state machine against a naive model ------------------------------------------------------

POOL = 48
Key = tuple[str | None, tuple[int, ...]]


@dataclass(slots=True)
class Req:
    ns: str | None
    tokens: list[int]
    slots: list[int]  # [0, locked_len) the tree's, locked; the rest the request's own
    locked_len: int
    handle: Any

    @property
    def computed(self) -> int:
        return len(self.slots)


# Prompts as a cut of one of a few base sequences plus a random tail: shared prefixes diverging
# anywhere, mid-page included, which independent random lists rarely produce.
_BASES = [[0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0], [0, 1, 2, 0, 2, 2, 1, 1, 0, 0, 2, 1]]
tokens_st = st.builds(
    lambda base, cut, tail: base[:cut] + tail,
    st.sampled_from(_BASES),
    st.integers(0, 16),
    st.lists(st.integers(0, 2), max_size=6),
)
ns_st = st.sampled_from([None, "a"])


class RadixMachine(RuleBasedStateMachine):
    """The scheduler's use of the cache, checked against `ref`: every cached page-aligned prefix
    (namespace, tokens) -> the slots of its last page."""

    page_size = 1

    def __init__(self) -> None:
        super().__init__()
        self.alloc = SlotAllocator(POOL)
        self.cache = RadixCache(self.alloc, page_size=self.page_size)
        self.ref: dict[Key, tuple[int, ...]] = {}
        self.reqs: list[Req] = []

    # -- the naive model --

    def ref_match(self, ns: str | None, toks: list[int]) -> list[int]:
        out: list[int] = []
        p = self.page_size
        for k in range(p, len(toks) + 1, p):
            page = self.ref.get((ns, tuple(toks[:k])))
            if page is None:
                break
            out.extend(page)
        return out

    def ref_insert(self, ns: str | None, toks: list[int], slots: list[int]) -> int:
        p, present, cached_len = self.page_size, True, 0
        for k in range(p, len(toks) + 1, p):
            key = (ns, tuple(toks[:k]))
            if key in self.ref and present:
                cached_len = k
            else:
                assert key not in self.ref  # prefix-closed
                present = False
                self.ref[key] = tuple(slots[k - p : k])
        return cached_len

    def locked_keys(self) -> set[Key]:
        p = self.page_size
        return {
            (r.ns, tuple(r.tokens[:k])) for r in self.reqs for k in range(p, r.locked_len + 1, p)
        }

    def sync_after_evict(self, asked: int, freed: int) -> None:
        cached = set(self.cache.cached_slots())
        gone = [k for k, v in self.ref.items() if not cached.issuperset(v)]
        assert all(cached.isdisjoint(self.ref[k]) for k in gone), "a page half evicted"
        assert not set(gone) & self.locked_keys(), "evicted a locked prefix"
        assert freed == self.page_size * len(gone)
        assert freed >= asked or self.cache.evictable_size == 0
        for k in gone:
            del self.ref[k]

    def evict(self, n: int) -> None:
        self.sync_after_evict(n, self.cache.evict(n))

    def alloc_slots(self, n: int) -> list[int] | None:
        if n > self.alloc.num_free:
            self.evict(n - self.alloc.num_free)
        return self.alloc.alloc(n)

    def offer(self, r: Req, n: int) -> int:
        """insert the first n computed tokens; free the request's duplicates; return cached_len."""
        res = self.cache.insert(r.tokens[:n], r.slots[:n], r.ns)
        assert res.cached_len == self.ref_insert(r.ns, r.tokens[:n], r.slots[:n])
        assert res.cached_len >= r.locked_len
        self.alloc.free(r.slots[r.locked_len : res.cached_len])
        return res.cached_len

    def check_match(self, ns: str | None, toks: list[int], count: bool = True) -> Any:
        m = self.cache.match_prefix(toks, ns, count_stats=count)
        assert m.slots == self.ref_match(ns, toks)
        return m

    # -- rules --

    @precondition(lambda self: len(self.reqs) < 4)
    @rule(toks=tokens_st, ns=ns_st)
    def admit(self, toks: list[int], ns: str | None) -> None:
        m = self.check_match(ns, toks)
        self.cache.lock(m.handle)
        self.reqs.append(Req(ns, toks, list(m.slots), len(m.slots), m.handle))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), cache_chunk=st.booleans())
    def prefill_chunk(self, data: st.DataObject, cache_chunk: bool) -> None:
        r = data.draw(st.sampled_from(self.reqs))
        left = len(r.tokens) - r.computed
        if left == 0:
            return
        new = self.alloc_slots(data.draw(st.integers(1, left)))
        if new is None:
            return
        r.slots += new
        if not cache_chunk:
            return
        self.offer(r, r.computed)
        old, toks = r.handle, r.tokens[: r.computed]
        m = self.check_match(r.ns, toks, count=False)
        assert len(m.slots) == self.cache.aligned_len(len(toks))
        self.cache.lock(m.handle)
        self.cache.unlock(old)
        r.slots[: len(m.slots)] = m.slots
        r.handle, r.locked_len = m.handle, len(m.slots)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), finish=st.booleans())
    def release(self, data: st.DataObject, finish: bool) -> None:
        r = data.draw(st.sampled_from(self.reqs))
        if finish:
            cached_len = self.offer(r, r.computed)
            self.alloc.free(r.slots[max(cached_len, self.cache.aligned_len(r.computed)) :])
        else:  # abort without caching
            self.alloc.free(r.slots[r.locked_len :])
        self.cache.unlock(r.handle)
        self.reqs.remove(r)

    @rule(toks=tokens_st, ns=ns_st)
    def insert_fresh(self, toks: list[int], ns: str | None) -> None:
        slots = self.alloc_slots(len(toks))
        if slots is None:
            return
        r = Req(ns, toks, slots, 0, None)
        cached_len = self.offer(r, len(toks))
        self.alloc.free(slots[max(cached_len, self.cache.aligned_len(len(toks))) :])

    @rule(toks=tokens_st, ns=ns_st)
    def match(self, toks: list[int], ns: str | None) -> None:
        self.check_match(ns, toks)

    @rule(n=st.integers(0, POOL))
    def evict_some(self, n: int) -> None:
        self.evict(n)

    @rule()
    def flush(self) -> None:
        locked = any(r.locked_len for r in self.reqs)
        assert self.cache.flush() is not locked
        if not locked:
            self.ref.clear()

    @invariant()
    def consistent(self) -> None:
        in_use = [s for r in self.reqs for s in r.slots[r.locked_len :]]
        check_integrity(self.alloc, self.cache, in_use)
        protected = self.page_size * len(self.locked_keys())
        assert self.cache.protected_size == protected
        assert self.cache.evictable_size == self.page_size * len(self.ref) - protected
        assert sorted(self.cache.cached_slots()) == sorted(s for v in self.ref.values() for s in v)
        for r in self.reqs:
            assert r.slots[: r.locked_len] == self.ref_match(r.ns, r.tokens[: r.locked_len])


class PagedRadixMachine(RadixMachine):
    page_size = 4


_settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
TestRadixMachine = RadixMachine.TestCase
TestRadixMachine.settings = _settings
TestPagedRadixMachine = PagedRadixMachine.TestCase
TestPagedRadixMachine.settings = _settings
