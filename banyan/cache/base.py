"""The prefix-cache interface the scheduler talks to. Knows token ids and slot indices only.

Ownership contract (what makes leaks impossible to miss):
- Slots returned by `match_prefix` belong to the cache; they stay valid only while the returned
  handle is locked (`lock`), and the caller must not free them.
- `insert(tokens, slots)` offers the cache the KV of `tokens`. `InsertResult.cached_len` says how
  many leading tokens the cache did NOT take from this call (they were already cached, or the
  cache keeps nothing): the caller frees its own slots among `slots[:cached_len]`. Everything from
  `cached_len` on now belongs to the cache.
- `evict(n)` frees at least n unlocked cached slots back to the allocator when it can, least
  recently used first, and returns how many it freed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(slots=True)
class MatchResult:
    slots: list[int]  # KV slots of the longest cached prefix (page-aligned)
    handle: Any  # opaque: the last matched node, to lock/unlock


@dataclass(slots=True)
class InsertResult:
    cached_len: int  # leading tokens the cache did not take from this call
    handle: Any  # node now holding the full inserted sequence (lock it to keep it)


class PrefixCache(ABC):
    """Maps token-id prefixes (optionally per namespace) to KV slots."""

    #: False for the no-reuse baseline: the scheduler skips caching unfinished requests.
    keeps_prefixes: bool = True
    page_size: int = 1

    def aligned_len(self, n: int) -> int:
        """n rounded down to whole pages: the most of n tokens the cache can take or match."""
        return n // self.page_size * self.page_size

    @abstractmethod
    def match_prefix(self, tokens: Sequence[int], namespace: str | None = None, *,
                     count_stats: bool = True) -> MatchResult:
        """count_stats=False for look-ups that are not a request's admission (scheduling
        policy, re-matching after an insert), so hit-rate counters stay exact."""

    @abstractmethod
    def insert(
        self, tokens: Sequence[int], slots: Sequence[int], namespace: str | None = None
    ) -> InsertResult: ...

    @abstractmethod
    def lock(self, handle: Any) -> None: ...

    @abstractmethod
    def unlock(self, handle: Any) -> None: ...

    @abstractmethod
    def evict(self, num_slots: int) -> int: ...

    def shared_len(self, handle: Any) -> int | None:
        """How many of a locked handle's first slots another lock may also hold (another
        running request's prefix); None: not known."""
        return None if handle is not None else 0

    @property
    @abstractmethod
    def evictable_size(self) -> int:
        """Cached slots no running request holds: what `evict` could free."""

    @property
    @abstractmethod
    def protected_size(self) -> int:
        """Cached slots locked by running requests."""

    @property
    def cached_size(self) -> int:
        return self.evictable_size + self.protected_size

    @abstractmethod
    def flush(self) -> bool:
        """Drop every cached prefix; refuse (return False) while any is locked."""

    @abstractmethod
    def cached_slots(self) -> list[int]:
        """Every slot the cache owns (for the integrity check)."""


class LowerTier(Protocol):
    """A KV store under the prefix cache (banyan/cache/tier): what the scheduler asks of it.
    Torch-free on this side; `load` and `save` copy K/V between the store and pool slots."""

    def held(self, tokens: Sequence[int], namespace: str | None, start: int) -> int:
        """Tokens past `start` the tier holds (whole blocks chained from the first)."""
        ...

    def loadable(self, tokens: Sequence[int], namespace: str | None, start: int) -> int:
        """Tokens past `start` the tier holds and would load (0: none, or recomputing wins)."""
        ...

    def load(self, tokens: Sequence[int], namespace: str | None, start: int,
             slots: Sequence[int]) -> int:
        """Load tokens[start:start+len(slots)] into `slots`; how many leading ones loaded."""
        ...

    def save(self, tokens: Sequence[int], namespace: str | None, slots: Sequence[int]) -> None:
        """Keep the KV of `tokens` (now in `slots`): copied before this returns."""
        ...

    def observe_compute(self, tokens: int, seconds: float) -> None:
        """A step computed `tokens` prompt tokens in `seconds` (the load/recompute estimate)."""
        ...

    def close(self) -> None:
        """Finish the writes still queued."""
        ...

    def counters(self) -> dict[str, float]:
        """Cumulative counters and sizes, by name (metrics, /server_info)."""
        ...
