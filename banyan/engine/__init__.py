"""The engine layer: EngineCore (requests in, updates out, the door to the scheduler), its
builder from EngineArgs, the offline `Engine` API and the incremental detokenizer.

Its modules are imported by path (`banyan.engine.core`, ...): importing this package alone (as
`banyan.engine.detok` does) loads nothing heavy."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from banyan.engine.core import CoreStats, EngineCore, SampleGroup
    from banyan.engine.offline import Engine

__all__ = ["CoreStats", "Engine", "EngineCore", "SampleGroup"]


def __getattr__(name: str) -> Any:
    if name in ("CoreStats", "EngineCore", "SampleGroup"):
        from banyan.engine import core

        return getattr(core, name)
    if name == "Engine":
        from banyan.engine.offline import Engine

        return Engine
    raise AttributeError(f"module 'banyan.engine' has no attribute {name!r}")
