"""File-system helpers shared by the model builders."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def build_dir_atomically(target: Path, prefix: str, build: Callable[[Path], object]) -> Path:
    """Build a folder in a temporary sibling and rename it to `target`, so a crash never leaves
    half a folder behind; when another process won the race, its copy is kept."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
    try:
        build(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; use its copy
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
