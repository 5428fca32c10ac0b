"""The KV tier under the prefix cache (HiCache): blocks of KV saved off the device pool, loaded
back into free slots when a prompt's prefix is found there.

Write-through: when a prompt chunk has been computed, and when a request gives up its KV
(finished, aborted, retracted), the full blocks of its computed tokens that the tier lacks are
copied out of the pool at once (a gather, on the engine thread: the slots may be reused by the
next step) and written to the store by a background thread, off the step loop. Saving at each
chunk lets a replica sharing the store use a prompt while its first request still decodes.
Writing at release rather than at eviction means an eviction costs nothing and every block is
written whole at its absolute position (an evicted radix leaf can start mid-block). SGLang's
`write_through` policy does the same.

Loading: on admission, after the device match, the scheduler asks `loadable` how many more
tokens the tier holds (whole blocks, chained from block 0) and whether loading them beats
recomputing (`LoadCostModel`); it allocates slots and `load` verifies each block file and copies
it into the pool, stopping at the first block that fails its check.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import xxhash

from banyan.cache.tier.blocks import block_keys, chain_seed
from banyan.cache.tier.file_store import StoreStats
from banyan.mem.kv_pool import KVPool

logger = logging.getLogger(__name__)

MAX_PENDING_BYTES = 256 * 2**20  # blocks queued for writing beyond this are dropped, not waited for


@dataclass(slots=True)
class TierStats:
    saved_blocks: int = 0
    saved_bytes: int = 0
    dropped_blocks: int = 0  # not saved: the write queue was full
    loaded_blocks: int = 0
    loaded_tokens: int = 0
    loaded_bytes: int = 0
    load_seconds: float = 0.0
    recompute_preferred: int = 0  # tier hits left unused because recomputing was estimated faster


def model_identity(model: torch.nn.Module, kv_dtype: torch.dtype, extra: str = "") -> str:
    """What a stored block's K/V depends on besides its tokens: the weights (the first values of
    every parameter, so two fine-tunes of one architecture differ), their layout and the KV
    dtype. Part of every block key: another model's blocks are simply never found. A tensor
    reachable twice (a tied LM head made at load, whose existence depends on which linear method
    the load picked) counts once, so the identity is the checkpoint's, not the run's layout."""
    digest = xxhash.xxh3_128()
    digest.update(f"{kv_dtype}|{extra}".encode())
    seen: set[int] = set()
    for name, param in model.named_parameters():
        if param.data_ptr() in seen:
            continue
        seen.add(param.data_ptr())
        head = param.detach().reshape(-1)[:256].float().cpu()
        digest.update(name.encode() + str(tuple(param.shape)).encode())
        digest.update(head.numpy().tobytes())
    return digest.hexdigest()


class LoadCostModel:
    """Loading n tokens costs `overhead + n * bytes_per_token / read_rate`; recomputing them
    costs `n / compute_rate`. Both rates are measured as the engine runs (exponential averages):
    read_rate from the tier's own loads, compute_rate from steps that computed prompt chunks.
    Until a prefill has been seen, loading is assumed to win (on a CPU it does by ~100x)."""

    def __init__(self, bytes_per_token: int, read_rate: float = 1e9, overhead_s: float = 1e-3,
                 smoothing: float = 0.3) -> None:
        self.bytes_per_token = bytes_per_token
        self.read_rate = read_rate  # bytes/s
        self.compute_rate: float | None = None  # tokens/s of prompt computation
        self.overhead_s = overhead_s
        self._alpha = smoothing

    def observe_load(self, nbytes: int, seconds: float) -> None:
        if nbytes and seconds > 0:
            self.read_rate += self._alpha * (nbytes / seconds - self.read_rate)

    def observe_compute(self, tokens: int, seconds: float) -> None:
        if tokens and seconds > 0:
            rate = tokens / seconds
            self.compute_rate = rate if self.compute_rate is None else \
                self.compute_rate + self._alpha * (rate - self.compute_rate)

    def load_seconds(self, tokens: int) -> float:
        return self.overhead_s + tokens * self.bytes_per_token / self.read_rate

    def worth_loading(self, tokens: int) -> bool:
        if self.compute_rate is None:
            return True
        return self.load_seconds(tokens) < tokens / self.compute_rate


class BlockStore(Protocol):
    """Where blocks are kept (file_store.FileStore, mooncake_store.MooncakeStore): a block is
    stored whole with its header, and `get` returns its payload only if every check passes."""

    budget: int
    stats: StoreStats

    def contains(self, key: str) -> bool: ...

    def put(self, key: str, tokens: Sequence[int], payload: bytes | memoryview) -> None: ...

    def get(self, key: str, tokens: Sequence[int], payload_bytes: int) -> memoryview | None: ...

    def close(self) -> None: ...


class KVTier:
    def __init__(self, pool: KVPool, store: BlockStore, block_tokens: int, identity: str) -> None:
        if block_tokens < 1:
            raise ValueError(f"hicache_block_tokens must be >= 1, got {block_tokens}")
        self.pool = pool
        self.store = store
        self.block_tokens = block_tokens
        self.identity = identity
        self.stats = TierStats()
        self.block_bytes = pool.bytes_per_slot * block_tokens
        self.costs = LoadCostModel(pool.bytes_per_slot)
        self._pending: set[str] = set()  # keys queued for writing
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[str, list[int], torch.Tensor] | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="banyan-kv-tier",
                                        daemon=True)
        self._writer.start()

    # ---- scheduler side ----------------------------------------------------------------------

    def held(self, tokens: Sequence[int], namespace: str | None, start: int) -> int:
        """How many tokens past `start` the tier holds, in whole blocks."""
        B = self.block_tokens
        first = start // B
        n = 0
        for key in block_keys(chain_seed(self.identity, namespace), tokens, B, first):
            if not self.store.contains(key):
                break
            n += 1
        return max((first + n) * B - start, 0) if n else 0

    def loadable(self, tokens: Sequence[int], namespace: str | None, start: int) -> int:
        """`held`, when loading those tokens is estimated faster than computing them (else 0)."""
        count = self.held(tokens, namespace, start)
        if count > 0 and not self.costs.worth_loading(count):
            self.stats.recompute_preferred += 1
            return 0
        return count

    def load(self, tokens: Sequence[int], namespace: str | None, start: int,
             slots: Sequence[int]) -> int:
        """Copy the KV of tokens[start:start+len(slots)] from the tier into `slots`; returns how
        many leading ones were loaded (blocks are checked one by one; the first bad one stops)."""
        if not slots:
            return 0
        t0 = time.perf_counter()
        B = self.block_tokens
        first, end = start // B, start + len(slots)
        keys = block_keys(chain_seed(self.identity, namespace), tokens, B, first,
                          (end - 1) // B + 1 - first)
        loaded = read = 0
        for j, key in enumerate(keys, start=first):
            data = self.store.get(key, tokens[j * B:(j + 1) * B], self.block_bytes)
            if data is None:
                break
            block = self.pool.unpack(data, B)  # [L, 2, B, row bytes]
            lo, hi = max(start, j * B) - j * B, min(end, (j + 1) * B) - j * B
            self.pool.scatter(block[:, :, lo:hi], slots[loaded:loaded + hi - lo])
            loaded += hi - lo
            read += 1
        if not loaded:
            return 0
        nbytes = read * self.block_bytes
        seconds = time.perf_counter() - t0
        self.costs.observe_load(nbytes, seconds)
        s = self.stats
        s.loaded_blocks += read
        s.loaded_tokens += loaded
        s.loaded_bytes += nbytes
        s.load_seconds += seconds
        return loaded

    def save(self, tokens: Sequence[int], namespace: str | None, slots: Sequence[int]) -> None:
        """Write-through: queue the full blocks of `tokens` (whose KV is in `slots`) that the
        tier lacks. Their KV is copied now; the files are written in the background."""
        B = self.block_tokens
        keys = block_keys(chain_seed(self.identity, namespace), tokens, B)
        new: list[int] = []
        with self._lock:
            for j, key in enumerate(keys):
                if key in self._pending or self.store.contains(key):
                    continue
                if self._pending_bytes + self.block_bytes > MAX_PENDING_BYTES:
                    self.stats.dropped_blocks += 1
                    continue
                self._pending.add(key)
                self._pending_bytes += self.block_bytes
                new.append(j)
        if not new:
            return
        out = self.pool.gather([s for j in new for s in slots[j * B:(j + 1) * B]])
        for i, j in enumerate(new):
            self._queue.put((keys[j], list(tokens[j * B:(j + 1) * B]),
                             out[:, :, i * B:(i + 1) * B]))

    def counters(self) -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = {f: getattr(self.stats, f) for f in TierStats.__slots__}
        store = self.store.stats
        out.update(files=store.files, bytes_used=store.bytes_used,
                   evicted_files=store.evicted_files, corrupt_files=store.corrupt_files,
                   budget_bytes=self.store.budget, block_tokens=self.block_tokens,
                   read_bytes_per_s=self.costs.read_rate,
                   compute_tokens_per_s=self.costs.compute_rate or 0.0)
        return out

    def observe_compute(self, tokens: int, seconds: float) -> None:
        self.costs.observe_compute(tokens, seconds)

    def flush(self) -> None:
        """Wait until every queued block is written (tests, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._writer.join(timeout=10)
        self.store.close()

    # ---- the writer thread -------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, block_tokens, kv = item
                payload = kv.contiguous().view(torch.uint8).numpy()
                try:
                    self.store.put(key, block_tokens, memoryview(payload).cast("B"))
                    with self._lock:
                        self.stats.saved_blocks += 1
                        self.stats.saved_bytes += payload.nbytes
                except OSError as exc:
                    logger.warning("KV tier: could not write block %s: %s", key, exc)
                    with self._lock:
                        self.stats.dropped_blocks += 1
                finally:
                    with self._lock:
                        self._pending.discard(key)
                        self._pending_bytes -= self.block_bytes
            finally:
                self._queue.task_done()
