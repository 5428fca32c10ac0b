"""Banyan: an LLM inference and serving engine."""

from banyan.engine import Engine
from banyan.outputs import CompletionOutput, RequestOutput, StreamChunk
from banyan.sampling.params import SamplingParams

__all__ = ["CompletionOutput", "Engine", "RequestOutput", "SamplingParams", "StreamChunk"]
__version__ = "0.1.0"
