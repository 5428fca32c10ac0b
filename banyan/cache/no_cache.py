"""The no-reuse baseline (`--no-prefix-cache`): nothing is ever cached."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from banyan.cache.base import InsertResult, MatchResult, PrefixCache


class NoPrefixCache(PrefixCache):
    keeps_prefixes = False

    def match_prefix(self, tokens: Sequence[int], namespace: str | None = None, *,
                     count_stats: bool = True) -> MatchResult:
        return MatchResult(slots=[], handle=None)

    def insert(
        self, tokens: Sequence[int], slots: Sequence[int], namespace: str | None = None
    ) -> InsertResult:
        # Takes nothing: the caller frees every slot it offered.
        return InsertResult(cached_len=len(tokens), handle=None)

    def lock(self, handle: Any) -> None:
        pass

    def unlock(self, handle: Any) -> None:
        pass

    def evict(self, num_slots: int) -> int:
        return 0

    @property
    def evictable_size(self) -> int:
        return 0

    @property
    def protected_size(self) -> int:
        return 0

    def flush(self) -> bool:
        return True

    def cached_slots(self) -> list[int]:
        return []
