"""Attention backends: one interface (base.py), a registry (registry.py), the portable SDPA
backend (torch_backend.py), the C++ CPU backend (cpu_native.py) and the Triton GPU backend
(triton_backend.py; it imports triton only when built)."""

from banyan.attention.base import AttentionBackend, AttentionMetadata
from banyan.attention.cpu_native import CpuNativeBackend, NativeMetadata
from banyan.attention.registry import backend_names, create_backend, register_backend
from banyan.attention.torch_backend import SdpaBackend, TorchAttentionMetadata
from banyan.attention.triton_backend import TritonBackend, TritonMetadata

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "CpuNativeBackend",
    "NativeMetadata",
    "SdpaBackend",
    "TorchAttentionMetadata",
    "TritonBackend",
    "TritonMetadata",
    "backend_names",
    "create_backend",
    "register_backend",
]
