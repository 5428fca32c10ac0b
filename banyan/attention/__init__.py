"""Attention backends: one interface (base.py), a portable PyTorch implementation."""

from banyan.attention.base import AttentionBackend, AttentionMetadata
from banyan.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "TorchAttentionBackend",
    "TorchAttentionMetadata",
]
