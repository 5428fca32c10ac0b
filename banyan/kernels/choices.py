"""Timing questions about the native kernels, answered once per machine and remembered."""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from banyan.kernels import native


def remembered(question: str, measure: Callable[[], bool]) -> bool:
    """The answer to a timing question about the kernels ("is the skinny kernel faster than
    F.linear for this weight?"), measured once per machine and kept beside the library (keyed by
    it: sources, flags, CPU), torch's version and thread count. Under a file lock, so processes
    started together (server replicas) all take the first one's answer: a timing decided per
    process let two replicas of one model pick different kernels and differ in the last bits."""
    lib = native.load()
    assert lib is not None, "native kernels unavailable"
    key = f"{Path(lib._name).stem} torch-{torch.__version__} threads-{torch.get_num_threads()} "
    key += question
    folder = native.cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "choices.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = folder / "choices.json"
        try:
            answers = json.loads(path.read_text())
        except (OSError, ValueError):
            answers = {}
        if not isinstance(answers.get(key), bool):
            answers[key] = bool(measure())
            fd, tmp = tempfile.mkstemp(suffix=".json", dir=folder)
            with os.fdopen(fd, "w") as f:
                json.dump(answers, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        return answers[key]
