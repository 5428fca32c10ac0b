"""Fault the KV pool's pages in while the engine has nothing to do.

The CPU pool is an anonymous mapping the OS fills page by page on first touch (kv_pool.lazy_zeros:
start-up does not wait for gigabytes to be zeroed). Those first touches then happen inside
steps: on the Firecracker VMs this project runs on, a page fault costs 0.4-2 ms per MiB
(the host backs freed guest memory again on demand), and a 64 x 128-token prefill spent ~0.5 s
of its ~5 s in them, a 64-request decode step ~3 ms of its ~70 storing K/V into fresh pages
(Zen 4, docs/performance.md). vLLM and llama.cpp zero their caches at start-up instead.

So an idle engine populates the pool a chunk at a time, lowest slots first (the order the
allocator hands them out), with madvise(MADV_POPULATE_WRITE): the kernel faults the pages in
as a write would, without changing a byte, so it is safe on slots already in use. The call
runs in the engine's own thread between polls for work (never beside a step), and ctypes
releases the GIL during it. Where the kernel lacks the advice (before Linux 5.14) nothing is
populated and pages fault in as before.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import sys
import time
from collections.abc import Sequence

import torch

from banyan.runner.device import available_memory

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h (5.14+)
CHUNK_BYTES = 8 << 20  # one idle turn's share: a few ms here, so a request that arrives waits
# at most that long
# Stop while at least this much of the host's memory is still available: a pool sized past the
# RAM left (an explicit --kv-cache-memory; pages are only taken as used) keeps faulting in as it
# fills instead of pushing the host out of memory while the engine idles.
KEEP_AVAILABLE = 1 << 30


class PoolPrefaulter:
    """Populates `regions` (CPU tensors indexed by slot, each in its own mapping) slot range by
    slot range; `step` does one chunk, `done` says when all is populated or cannot be."""

    def __init__(self, regions: Sequence[torch.Tensor], num_slots: int) -> None:
        self._regions = [r for r in regions if r.device.type == "cpu" and r.numel() > 0]
        self._num_slots = num_slots
        self._next_slot = 0
        self._row_bytes = sum(r.numel() * r.element_size() // num_slots for r in self._regions)
        self._seconds = 0.0
        self._madvise = _libc_madvise()
        self.done = self._madvise is None or not self._regions

    def step(self, max_bytes: int = CHUNK_BYTES) -> bool:
        """Populate the next slots, about max_bytes over all regions; True while more remain."""
        if self.done:
            return False
        if available_memory(torch.device("cpu")) < KEEP_AVAILABLE + max_bytes:
            logger.info("KV pool: %d of %d slots populated; the rest fault in as used (the "
                        "host's available memory is low)", self._next_slot, self._num_slots)
            self.done = True
            return False
        t0 = time.perf_counter()
        first = self._next_slot
        last = min(self._num_slots, first + max(1, max_bytes // max(1, self._row_bytes)))
        for region in self._regions:
            row = region.numel() * region.element_size() // self._num_slots
            start = region.data_ptr() + first * row
            aligned = start - start % mmap.PAGESIZE  # (that page may be populated already)
            length = region.data_ptr() + last * row - aligned
            if length > 0 and self._madvise(aligned, length, MADV_POPULATE_WRITE) != 0:
                code = ctypes.get_errno()
                logger.info("KV pool pages fault in as used (madvise populate: %s)",
                            errno.errorcode.get(code, code))
                self.done = True
                return False
        self._next_slot = last
        self._seconds += time.perf_counter() - t0
        if last >= self._num_slots:
            self.done = True
            logger.info("KV pool populated in %.2f s of idle time", self._seconds)
        return not self.done

    @property
    def populated_slots(self) -> int:
        return self._next_slot


def _libc_madvise() -> ctypes._CFuncPtr | None:
    if not sys.platform.startswith("linux"):  # (the advice's number is Linux's)
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn
