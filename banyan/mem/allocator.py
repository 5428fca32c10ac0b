"""Free list of KV slots. Pure Python: the scheduler owns it and never touches tensors."""

from __future__ import annotations

from collections.abc import Iterable

# Slot 0 is never handed out: padded positions (CUDA graphs, dummy rows) write their KV there.
PAD_SLOT = 0


class SlotAllocator:
    """Hands out KV slot indices 1..num_slots-1 from a free list (LIFO, so recently freed slots,
    still warm in cache, are reused first)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 2:
            raise ValueError(f"KV pool needs at least 2 slots, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, PAD_SLOT, -1))

    @property
    def capacity(self) -> int:
        """Slots that can ever be handed out."""
        return self.num_slots - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """n slots, or None (and nothing taken) when fewer than n are free."""
        if n > len(self._free):
            return None
        if n == 0:
            return []
        taken = self._free[-n:]
        taken.reverse()  # ascending runs of slots: contiguous KV reads when the pool is fresh
        del self._free[-n:]
        return taken

    def free(self, slots: Iterable[int]) -> None:
        # Reversed so that the next alloc hands these back in their original order.
        self._free.extend(reversed(list(slots)))

    def free_set(self) -> set[int]:
        return set(self._free)
