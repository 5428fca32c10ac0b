"""Plain torch building blocks of the Llama family: RMSNorm, RoPE, SiLU-and-mul."""

from banyan.layers.activation import silu_and_mul
from banyan.layers.norm import RMSNorm
from banyan.layers.rotary import RotaryEmbedding, apply_rotary

__all__ = ["RMSNorm", "RotaryEmbedding", "apply_rotary", "silu_and_mul"]
