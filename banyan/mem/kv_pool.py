"""The KV cache: one preallocated K and V tensor per layer, indexed by slot.

Slot s of every layer holds the K/V of one token; the scheduler's `SlotAllocator` hands slots
out and the request-to-token table says which slots hold a request's positions. Slot 0
(`PAD_SLOT`) is never handed out: padded tokens may write there, and masked-out positions of a
gather read it, so it must only ever hold finite values (the pool starts zeroed).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from banyan.mem.allocator import PAD_SLOT


def kv_bytes_per_slot(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token's K and V take over all layers."""
    elem = torch.empty((), dtype=dtype).element_size()
    return layers * 2 * kv_heads * head_dim * elem


def num_slots_for_bytes(
    budget: int, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Slots (including the padding slot) that fit in `budget` bytes."""
    slots = budget // kv_bytes_per_slot(layers, kv_heads, head_dim, dtype)
    if slots < 2:
        raise ValueError(
            f"KV cache budget of {budget} bytes holds {slots} slots; at least 2 are needed "
            f"({kv_bytes_per_slot(layers, kv_heads, head_dim, dtype)} bytes per token)"
        )
    return slots


class KVPool:
    def __init__(
        self,
        layers: int,
        num_slots: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_slots < 2:
            raise ValueError(
                f"KV pool needs at least 2 slots (slot {PAD_SLOT} is padding), got {num_slots}"
            )
        self.layers = layers
        self.num_slots = num_slots
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        # Zeroed, not empty: gathers read slot 0 (and stale slots) under a mask, and a NaN in
        # garbage memory would survive the mask (0 * NaN = NaN in the weighted sum of V).
        shape = (num_slots, kv_heads, head_dim)
        self.k: list[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(layers)
        ]
        self.v: list[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(layers)
        ]

    @property
    def bytes_per_slot(self) -> int:
        return kv_bytes_per_slot(self.layers, self.kv_heads, self.head_dim, self.dtype)

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_slot * self.num_slots

    def store(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots: [T] int64; k/v: [T, kv_heads, head_dim] -> written to layer `layer_id`."""
        self.k[layer_id].index_copy_(0, slots, k)
        self.v[layer_id].index_copy_(0, slots, v)

    def gather(self, slots: Sequence[int]) -> torch.Tensor:
        """The K/V of `slots`, copied out: [layers, 2 (k, v), n, kv_heads, head_dim] on the CPU
        (what the KV tier and the P/D transfer send)."""
        index = torch.tensor(list(slots), dtype=torch.int64, device=self.device)
        out = torch.empty((self.layers, 2, len(index), self.kv_heads, self.head_dim),
                          dtype=self.dtype)
        for layer in range(self.layers):
            out[layer, 0] = self.k[layer].index_select(0, index).cpu()
            out[layer, 1] = self.v[layer].index_select(0, index).cpu()
        return out

    def scatter(self, kv: torch.Tensor, slots: Sequence[int]) -> None:
        """kv [layers, 2, n, kv_heads, head_dim] into `slots`: a plain copy when the slots are
        one ascending run (the allocator hands out lowest-first, so they usually are), else an
        index copy."""
        first, n = slots[0], len(slots)
        run = slots[-1] - first == n - 1 and list(slots) == list(range(first, first + n))
        index = None if run else torch.tensor(list(slots), dtype=torch.int64, device=self.device)
        for layer in range(self.layers):
            for which, dest in enumerate((self.k[layer], self.v[layer])):
                if index is None:
                    dest[first:first + n].copy_(kv[layer, which])
                else:
                    dest.index_copy_(0, index, kv[layer, which])
