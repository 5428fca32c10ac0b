"""The `file` backend of the KV tier: one file per block in one directory, bounded by LRU.

A stored block (a file here, a value in the Mooncake store) is `MAGIC | u32 header length |
JSON header | payload`. The header names the block's
key, its tokens, the payload's size and its xxh3-64 checksum; a load checks all four, so a torn,
truncated, foreign or corrupted file is never used: it is deleted and counted, and the caller
recomputes those tokens. Files are written to a temporary name and renamed into place, so a
reader (another replica on the same directory, or this one after a restart) sees a whole file or
none. Torch-free: payloads are bytes.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import xxhash

logger = logging.getLogger(__name__)

MAGIC = b"BANYANKV\x01"
_LEN = struct.Struct("<I")
SUFFIX = ".kv"


def block_header(key: str, tokens: Sequence[int], payload: bytes | memoryview) -> bytes:
    """What precedes a block's payload in every store: MAGIC, the header's length, the header."""
    header = json.dumps({"key": key, "tokens": list(tokens), "payload_bytes": len(payload),
                         "checksum": xxhash.xxh3_64_hexdigest(payload)}).encode()
    return MAGIC + _LEN.pack(len(header)) + header


def verified_payload(data: bytearray, key: str, tokens: Sequence[int],
                     payload_bytes: int) -> memoryview | None:
    """The payload of a stored block (header + payload), or None unless its magic, key,
    tokens, size and checksum are all as expected."""
    head = len(MAGIC) + _LEN.size
    if len(data) < head or not data.startswith(MAGIC):
        return None
    (header_len,) = _LEN.unpack_from(data, len(MAGIC))
    try:
        header = json.loads(data[head : head + header_len])
    except (ValueError, UnicodeDecodeError):
        return None
    payload = memoryview(data)[head + header_len :]
    if (not isinstance(header, dict) or header.get("key") != key
            or header.get("tokens") != list(tokens)
            or header.get("payload_bytes") != payload_bytes or len(payload) != payload_bytes
            or header.get("checksum") != xxhash.xxh3_64_hexdigest(payload)):
        return None
    return payload


@dataclass(slots=True)
class StoreStats:
    files: int = 0
    bytes_used: int = 0
    evicted_files: int = 0  # deleted to stay within the budget
    corrupt_files: int = 0  # failed a check on load: deleted, recomputed


class FileStore:
    def __init__(self, directory: str | Path, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"hicache_size must be positive, got {budget_bytes}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.budget = budget_bytes
        self.stats = StoreStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file size, LRU first
        self._scan()

    def _path(self, key: str) -> Path:
        return self.directory / key[:2] / (key + SUFFIX)

    def _scan(self) -> None:
        """Find the blocks a previous run left (oldest first, by modification time)."""
        found: list[tuple[float, str, int]] = []
        for sub in self.directory.iterdir():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                if entry.name.endswith(SUFFIX) and entry.is_file():
                    st = entry.stat()
                    found.append((st.st_mtime, entry.name[: -len(SUFFIX)], st.st_size))
                elif entry.name.startswith(".tmp-"):  # a write cut short by a crash
                    os.unlink(entry.path)
        for _, key, size in sorted(found):
            self._index[key] = size
            self.stats.bytes_used += size
        self.stats.files = len(self._index)
        with self._lock:
            self._evict_over_budget()

    def contains(self, key: str) -> bool:
        """Whether the block is stored (files another replica wrote since are found too)."""
        with self._lock:
            if key in self._index:
                return True
        path = self._path(key)
        try:
            size = path.stat().st_size
        except OSError:
            return False
        with self._lock:
            if key not in self._index:
                self._index[key] = size
                self.stats.bytes_used += size
                self.stats.files = len(self._index)
        return True

    def put(self, key: str, tokens: Sequence[int], payload: bytes | memoryview) -> None:
        head = block_header(key, tokens, payload)
        path = self._path(key)
        path.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(head)
                f.write(payload)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        size = len(head) + len(payload)
        with self._lock:
            old = self._index.pop(key, None)
            self.stats.bytes_used += size - (old or 0)
            self._index[key] = size
            self._evict_over_budget()
            self.stats.files = len(self._index)

    def get(self, key: str, tokens: Sequence[int], payload_bytes: int) -> memoryview | None:
        """The block's payload, or None when it is missing or fails a check (then deleted)."""
        path = self._path(key)
        try:
            with open(path, "rb") as f:  # into a writable buffer: torch views it in place
                data = bytearray(os.fstat(f.fileno()).st_size)
                f.readinto(data)
        except OSError:
            self._forget(key)
            return None
        payload = verified_payload(data, key, tokens, payload_bytes)
        if payload is None:
            logger.warning("KV tier: block file %s failed its check; deleted, recomputing", path)
            with self._lock:
                self.stats.corrupt_files += 1
            self._forget(key, unlink=True)
            return None
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        return payload

    def close(self) -> None:
        """Nothing to release: every block is a file already."""

    def _forget(self, key: str, unlink: bool = False) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self.stats.bytes_used -= size
            self.stats.files = len(self._index)
        if unlink:
            try:
                os.unlink(self._path(key))
            except OSError:
                pass

    def _evict_over_budget(self) -> None:
        """Called with the lock held: delete least recently used files past the budget."""
        while self.stats.bytes_used > self.budget and self._index:
            key, size = self._index.popitem(last=False)
            self.stats.bytes_used -= size
            self.stats.evicted_files += 1
            try:
                os.unlink(self._path(key))
            except OSError:
                pass
