"""Slot accounting check: every KV slot is in exactly one place (free, cached, or held)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from banyan.cache.base import PrefixCache
from banyan.cache.radix import RadixCache
from banyan.mem.allocator import PAD_SLOT, SlotAllocator


class IntegrityError(AssertionError):
    pass


def check_integrity(
    allocator: SlotAllocator, cache: PrefixCache, in_use_slots: Iterable[int]
) -> None:
    """Raise IntegrityError unless free + cached + in use == capacity with each slot 1..capacity
    in exactly one place. `in_use_slots`: slots requests hold that the cache does not own (a
    running request's slots past its locked prefix). A RadixCache also checks its own tree.
    O(pool): for tests and debug runs, not the hot path."""
    if isinstance(cache, RadixCache):
        cache.check_invariants()
    free = allocator.free_set()
    if len(free) != allocator.num_free:
        raise IntegrityError("a slot is twice in the free list")
    cached = cache.cached_slots()
    in_use = list(in_use_slots)
    counts = Counter(cached)
    counts.update(in_use)
    counts.update(free)
    doubled = sorted(s for s, c in counts.items() if c > 1)
    if doubled:
        where = {
            s: [n for n, group in (("free", free), ("cached", cached), ("in use", in_use))
                if s in group]  # fmt: skip
            for s in doubled[:5]
        }
        raise IntegrityError(f"slots in two places: {where}")
    expected = set(range(1, allocator.num_slots))
    if counts.keys() != expected:
        leaked = sorted(expected - counts.keys())
        bogus = sorted(counts.keys() - expected)
        raise IntegrityError(
            f"free {len(free)} + cached {len(cached)} + in use {len(in_use)} != capacity "
            f"{allocator.capacity}; leaked {leaked[:10]}, out of range (or pad slot "
            f"{PAD_SLOT}) {bogus[:10]}"
        )
