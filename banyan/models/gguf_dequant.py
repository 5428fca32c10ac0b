"""Turning GGUF tensor blocks into plain arrays: the one place that knows which ggml types Banyan
reads and how each is stored once dequantized.

The arithmetic is `gguf.quants.dequantize` (llama.cpp's own Python reference, the same function
transformers uses when it loads a GGUF file), so a dequantized weight equals the reference bit
for bit. This module is numpy-only: the API server process, which has no torch, may convert a
GGUF file too.

Kept apart from the reader (gguf_loader.py) so that a later quantized linear can take the raw
blocks the reader yields unchanged and skip this step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

# ggml types the loader accepts. Block-quantized types dequantize to float32 (their values,
# scale x integer + offset, are exact in float32 but not in 16 bits); F16 and BF16 keep their
# own 16-bit encoding, which holds every value exactly.
QUANTIZED_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
PLAIN_TYPES = ("F32", "F16", "BF16")
SUPPORTED_TYPES = PLAIN_TYPES + QUANTIZED_TYPES


def check_supported(ggml_type: GGMLQuantizationType, tensor: str) -> None:
    if ggml_type.name not in SUPPORTED_TYPES:
        raise ValueError(
            f"GGUF tensor {tensor!r} has ggml type {ggml_type.name}, which Banyan cannot load; "
            f"supported: {', '.join(SUPPORTED_TYPES)}"
        )


def storage_dtype(ggml_type: GGMLQuantizationType) -> str:
    """The safetensors dtype a tensor of this ggml type is stored as after dequantization."""
    return {"F16": "F16", "BF16": "BF16"}.get(ggml_type.name, "F32")


def dequantize(raw: np.ndarray, ggml_type: GGMLQuantizationType,
               shape: tuple[int, ...]) -> np.ndarray:
    """Raw GGUF data (as GGUFReader maps it) -> float32 array of `shape` (row-major, HF order)."""
    from gguf.quants import dequantize as reference

    check_supported(ggml_type, "<tensor>")
    return np.ascontiguousarray(reference(raw, ggml_type), dtype=np.float32).reshape(shape)


def to_storage(raw: np.ndarray, ggml_type: GGMLQuantizationType,
               shape: tuple[int, ...]) -> np.ndarray:
    """The array to store for a tensor, in storage_dtype(ggml_type): float16 kept as is, bfloat16
    kept as its uint16 bit patterns (numpy has no bfloat16), everything else dequantized."""
    name = ggml_type.name
    if name == "F16":
        return np.ascontiguousarray(raw, dtype=np.float16).reshape(shape)
    if name == "BF16":
        return np.ascontiguousarray(raw).view(np.uint16).reshape(shape)
    return dequantize(raw, ggml_type, shape)
