"""Banyan: an LLM inference and serving engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from banyan.outputs import CompletionOutput, RequestOutput, StreamChunk
from banyan.sampling.params import SamplingParams

if TYPE_CHECKING:
    from banyan.engine import Engine

__all__ = ["CompletionOutput", "Engine", "RequestOutput", "SamplingParams", "StreamChunk"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # The engine (and with it torch, ~3 s to import) loads on first use: the API server, the
    # router and the CLI's other commands import `banyan.*` modules without ever needing it.
    if name == "Engine":
        from banyan.engine import Engine

        return Engine
    raise AttributeError(f"module 'banyan' has no attribute {name!r}")
