"""Attention backends: one interface (base.py), a registry (registry.py), the portable SDPA
backend (torch_backend.py) and the C++ CPU backend (cpu_native.py)."""

from banyan.attention.base import AttentionBackend, AttentionMetadata
from banyan.attention.cpu_native import CpuNativeBackend, NativeMetadata
from banyan.attention.registry import backend_names, create_backend, register_backend
from banyan.attention.torch_backend import SdpaBackend, TorchAttentionMetadata

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "CpuNativeBackend",
    "NativeMetadata",
    "SdpaBackend",
    "TorchAttentionMetadata",
    "backend_names",
    "create_backend",
    "register_backend",
]
