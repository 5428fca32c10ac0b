"""Finding a model folder and loading its tokenizer: no torch, no model code, so the API server
process can use them without importing the runner."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def resolve_model_dir(model: str | None) -> Path:
    if model is None:
        from banyan.demo import demo_model_dir

        path = demo_model_dir()
        logger.warning("Using the demo model (random weights: its text is meaningless). "
                       "Pass --model /path/to/hf-folder for a real model.")
        return path
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ValueError(f"model folder {model!r} does not exist (Banyan loads local folders only)")
    if not (path / "config.json").exists():
        raise ValueError(f"model folder {model!r} has no config.json")
    return path


def load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types here
        raise ValueError(f"cannot load a tokenizer from {str(path)!r}: {exc}") from exc
