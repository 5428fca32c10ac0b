"""The engine layer: EngineCore (requests in, updates out, the door to the scheduler), its
builder from EngineArgs, the offline `Engine` API and the incremental detokenizer."""

from banyan.engine.core import CoreStats, EngineCore, SampleGroup
from banyan.engine.offline import Engine

__all__ = ["CoreStats", "Engine", "EngineCore", "SampleGroup"]
