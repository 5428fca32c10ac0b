"""A GGUF file's metadata and tensor index, read fast.

gguf's `GGUFReader` makes a numpy view of every value of the metadata, the tokenizer's tokens
and merges included (~250,000 of them for SmolLM2): 3-4 s at every start of a server that
computes from the file's blocks, for what is a few fields and a tensor index. This reads the
header with `struct`: scalars and strings are kept, arrays are stepped over (`SkippedArray`
records their element type and count), and each tensor's data is a view of one read-only
memory map, typed and shaped as `GGUFReader` gives it (the same tensors, tested).

Format (GGUF v2/v3, little-endian): magic, version, tensor count, metadata count; the metadata
(key, value type, value); the tensor index (name, dims, type, offset); the data, from the first
multiple of `general.alignment` (32 by default) after the index.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32
# Types GGUFReader hands out as typed elements; every other type as raw block bytes.
ELEMENT_TYPES = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32,
                 27: np.int64, 28: np.float64}


@dataclass(frozen=True, slots=True)
class SkippedArray:
    element_type: int
    count: int


@dataclass(slots=True)
class GGUFTensorInfo:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # dims in the file's order (fastest first), as GGUFReader gives them
    data: np.ndarray  # a view of the file


class GGUFHeader:
    """`fields` (key -> value: int, float, bool, str or SkippedArray) and `tensors`."""

    def __init__(self, path: Path) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._map
        magic = buf[:4]
        if magic != b"GGUF":
            raise ValueError(f"not a GGUF file (magic {magic!r})")
        self._at = 4  # the read position
        version, n_tensors, n_fields = self._unpack("<I"), self._unpack("<Q"), self._unpack("<Q")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I"))
        index = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._unpack("<I")
            dims = np.array(struct.unpack_from(f"<{n_dims}Q", buf, self._at), dtype=np.uint64)
            self._at += 8 * n_dims
            index.append((name, dims, self._unpack("<I"), self._unpack("<Q")))
        align = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        start = self._at + (-self._at % align)
        self.tensors: list[GGUFTensorInfo] = []
        data_bytes = np.frombuffer(buf, dtype=np.uint8)  # read-only, shares the map
        for name, dims, type_id, offset in index:
            kind = GGMLQuantizationType(type_id)
            n_elems = int(np.prod(dims))
            np_dims = tuple(reversed(dims.tolist()))
            block, size = GGML_QUANT_SIZES[kind]
            element = ELEMENT_TYPES.get(type_id)
            first = start + offset
            if element is not None:
                data = data_bytes[first:first + n_elems * np.dtype(element).itemsize]
                data = data.view(element)
            else:
                data = data_bytes[first:first + n_elems * size // block]
                np_dims = quant_shape_to_byte_shape(np_dims, kind)
            self.tensors.append(GGUFTensorInfo(name, kind, dims, data.reshape(np_dims)))

    def _unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._map, self._at)
        self._at += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._unpack("<Q")
        text = self._map[self._at:self._at + n].decode("utf-8", "replace")
        self._at += n
        return text

    def _value(self, kind: int) -> Any:
        if kind in SCALARS:
            return self._unpack(SCALARS[kind])
        if kind == STRING:
            return self._string()
        if kind != ARRAY:
            raise ValueError(f"GGUF metadata value of unknown type {kind}")
        element, count = self._unpack("<I"), self._unpack("<Q")
        if element in SCALARS:
            self._at += struct.calcsize(SCALARS[element]) * count
        elif element == STRING:
            for _ in range(count):  # each string: a length, then its bytes
                self._at += 8 + struct.unpack_from("<Q", self._map, self._at)[0]
        else:  # arrays of arrays: each value read in turn
            for _ in range(count):
                self._value(element)
        return SkippedArray(element, count)
