"""The `mooncake` backend of the KV tier: Mooncake's distributed store (`MooncakeDistributedStore`
from `mooncake-transfer-engine-non-cuda`), shared by every replica that names the same master, so
a prefix one replica computed is a hit on another.

Each engine joins the store as a client over TCP and donates `--hicache-size` bytes of its own
memory to it (a block lives in the memory of whichever replica the master placed it on, and
leaves the store with that replica); the master (`mooncake_master`, started by the operator)
keeps the index and evicts when full. A stored value is a block exactly as in a file (header
with key, tokens, size and checksum, then the payload), so every load is checked the same way.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from banyan.cache.tier.file_store import StoreStats, block_header, verified_payload

logger = logging.getLogger(__name__)

SEEN_KEYS = 1 << 16  # stored keys remembered locally

INSTALL_HINT = ("the mooncake KV tier needs `pip install mooncake-transfer-engine-non-cuda` "
                "and Debian's libibverbs1 (apt-get install libibverbs1), even for TCP")


def _client() -> Any:
    # A client whose master is unreachable retries 20 x ~4.4 s by default: fail in seconds.
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise RuntimeError(f"{INSTALL_HINT} ({exc})") from exc
    return MooncakeDistributedStore()


class MooncakeStore:
    def __init__(self, master: str, metadata: str, budget_bytes: int, max_value_bytes: int,
                 local_hostname: str = "127.0.0.1") -> None:
        """master: the mooncake_master's RPC address (host:port); metadata: its HTTP metadata
        server (http://host:port/metadata) or P2PHANDSHAKE; budget_bytes: memory this engine
        donates to the store; max_value_bytes: the largest block (sizes the staging buffer)."""
        if budget_bytes <= 0:
            raise ValueError(f"hicache_size must be positive, got {budget_bytes}")
        self.budget = budget_bytes
        self.stats = StoreStats()
        self._lock = threading.Lock()
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._store = _client()
        buffer = max(64 * 2**20, 4 * max_value_bytes)
        rc = self._store.setup(local_hostname, metadata, budget_bytes, buffer, "tcp", "", master)
        if rc != 0:
            raise RuntimeError(f"could not join the Mooncake store at master {master} "
                               f"(metadata {metadata}): setup returned {rc}; is mooncake_master "
                               "running there?")

    def contains(self, key: str) -> bool:
        with self._lock:
            if key in self._seen:
                return True
        if self._store.is_exist(key) != 1:  # a round trip to the master (~0.1-0.3 ms)
            return False
        self._remember(key)
        return True

    def _remember(self, key: str) -> None:
        """Keys known to be stored, so the write-through of every chunk and release does not
        ask the master again. The master may evict one since (silently): a load then finds
        it gone, forgets it, and recomputes."""
        with self._lock:
            self._seen[key] = None
            self._seen.move_to_end(key)
            if len(self._seen) > SEEN_KEYS:
                self._seen.popitem(last=False)

    def put(self, key: str, tokens: Sequence[int], payload: bytes | memoryview) -> None:
        value = block_header(key, tokens, payload) + bytes(payload)
        rc = self._store.put(key, value)
        if rc != 0:  # the store is full (-200) or the value too large: the block is not kept
            raise OSError(f"Mooncake store refused block {key}: error {rc}")
        with self._lock:
            self.stats.files += 1
            self.stats.bytes_used += len(value)
        self._remember(key)

    def get(self, key: str, tokens: Sequence[int], payload_bytes: int) -> memoryview | None:
        data = self._store.get(key)  # b"" when missing (evicted, or its holder left)
        if not data:
            with self._lock:
                self._seen.pop(key, None)
            return None
        payload = verified_payload(bytearray(data), key, tokens, payload_bytes)
        if payload is None:
            logger.warning("KV tier: Mooncake block %s failed its check; removed, recomputing",
                           key)
            with self._lock:
                self.stats.corrupt_files += 1
            self._store.remove(key, True)
            with self._lock:
                self._seen.pop(key, None)
        return payload

    def close(self) -> None:
        self._store.close()
