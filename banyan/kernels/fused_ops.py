"""Python side of the fused element-wise CPU kernels (cpu_fused_ops.cpp): RMSNorm with the
residual add, SiLU-and-mul, RoPE on the fused qkv projection; and fp8 K/V rows quantized as
mem/kv_pool.py's rule says (cpu_kv_quant.cpp).

Each function returns None when the kernel cannot take its input (not a CPU float32/bfloat16
tensor, or the kernels are unavailable); the layers then run their PyTorch composition, which
computes the same values. On CUDA, with BANYAN_TRITON_FUSED=1, the first three run as Triton
kernels instead (kernels/triton_fused.py; off by default until measured on a GPU).
"""

from __future__ import annotations

import ctypes
import functools
import os
from types import ModuleType

import torch

from banyan.kernels import native

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
MAX_HEAD_DIM = 512  # the RoPE kernel's per-head scratch
_GPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _lookup(name: str, dtype: torch.dtype) -> ctypes._CFuncPtr | None:
    lib = native.load()
    return None if lib is None else getattr(lib, f"banyan_{name}_{_SUFFIX[dtype]}")


@functools.cache
def triton_fused_enabled() -> bool:
    return os.environ.get("BANYAN_TRITON_FUSED", "0") == "1"


def _gpu_kernels(x: torch.Tensor) -> ModuleType | None:
    """The Triton kernels where they take x (a CUDA tensor, and switched on), else None."""
    if x.device.type != "cuda" or x.dtype not in _GPU_DTYPES or not triton_fused_enabled():
        return None
    from banyan.kernels import triton_fused  # imports Triton: only where a GPU runs

    return triton_fused


def _kernel(name: str, x: torch.Tensor) -> ctypes._CFuncPtr | None:
    # called several times a layer per step: the lookup is cached (the string and getattr
    # cost about as much as a small kernel)
    if x.device.type != "cpu" or x.dtype not in _SUFFIX:
        return None
    return _lookup(name, x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """x: [T, n]. With residual: residual += x in place (rounded like torch's add), then RMSNorm
    of it; without: RMSNorm of x. -> (normed [T, n], the residual stream: residual or x)."""
    gpu = _gpu_kernels(x)
    fn = None if gpu is not None else _kernel("add_rms_norm", x)
    if (gpu is None and fn is None) or x.dim() != 2 or weight.dtype != x.dtype \
            or weight.shape != x.shape[1:]:
        return None
    base = x if residual is None else residual
    if not (base.is_contiguous() and x.is_contiguous() and weight.is_contiguous()):
        return None
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        return None
    if gpu is not None:
        return gpu.add_rms_norm(x, residual, weight, eps)
    out = torch.empty_like(x)
    add = x.data_ptr() if residual is not None else None
    rows, n = x.shape
    with native.kernel_range("banyan::add_rms_norm"):
        fn(base.data_ptr(), add, weight.data_ptr(), out.data_ptr(), rows, n, eps,
           torch.get_num_threads())
    return out, base


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """gate_up: [T, 2 * I] contiguous -> silu(gate) * up, [T, I]."""
    gpu = _gpu_kernels(gate_up)
    fn = None if gpu is not None else _kernel("silu_and_mul", gate_up)
    if (gpu is None and fn is None) or gate_up.dim() != 2 or not gate_up.is_contiguous() \
            or gate_up.shape[1] % 2:
        return None
    if gpu is not None:
        return gpu.silu_and_mul(gate_up)
    rows, width = gate_up.shape
    out = gate_up.new_empty((rows, width // 2))
    with native.kernel_range("banyan::silu_and_mul"):
        fn(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads())
    return out


def rope_qk(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """qkv: [T, (H + 2 KVH) D] (rows may be strided), cos/sin: [T, D/2] in its dtype ->
    rotated q [T, H, D], k [T, KVH, D], contiguous. q_norm/k_norm: per-head RMSNorm weights
    [D] applied before the rotation (Qwen3), both or neither."""
    gpu = _gpu_kernels(qkv)
    fn = None if gpu is not None else _kernel("rope_qk", qkv)
    if (gpu is None and fn is None) or qkv.dim() != 2 or qkv.stride(1) != 1 \
            or head_dim > MAX_HEAD_DIM:
        return None
    rows = qkv.shape[0]
    if head_dim % 2 or qkv.shape[1] < (heads + kv_heads) * head_dim:
        return None
    for table in (cos, sin):
        if not (table.dtype == qkv.dtype and table.shape == (rows, head_dim // 2)
                and table.is_contiguous()):
            return None
    if (q_norm is None) != (k_norm is None):
        return None
    for w in (q_norm, k_norm):
        if w is not None and not (
            w.dtype == qkv.dtype and w.shape == (head_dim,) and w.is_contiguous()
        ):
            return None
    if gpu is not None:
        return gpu.rope_qk(qkv, cos, sin, heads, kv_heads, head_dim, q_norm, k_norm, eps)
    q = qkv.new_empty((rows, heads, head_dim))
    k = qkv.new_empty((rows, kv_heads, head_dim))
    qn = q_norm.data_ptr() if q_norm is not None else None
    kn = k_norm.data_ptr() if k_norm is not None else None
    with native.kernel_range("banyan::rope_qk"):
        fn(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), qn, kn, eps,
           q.data_ptr(), k.data_ptr(), rows, heads, kv_heads, head_dim, torch.get_num_threads())
    return q, k


_FP8_NAMES = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
_PTR, _I64 = ctypes.c_void_p, ctypes.c_int64
_FP8_ARGS = {"quantize": [_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64],
             "dequantize": [_PTR, _PTR, _I64, _I64, _PTR, _I64, _I64]}


@functools.cache
def _fp8_rows(verb: str, code_dtype: torch.dtype) -> ctypes._CFuncPtr | None:
    """cpu_kv_quant.cpp's banyan_fp8_{verb}_rows_{e4m3|e5m2}, typed, or None where it cannot
    run (no library, not an fp8 dtype; the dequantizer needs AVX2 + F16C)."""
    lib = native.load()
    name = _FP8_NAMES.get(code_dtype)
    if lib is None or name is None or \
            (verb == "dequantize" and not lib.banyan_fp8_dequantize_here()):
        return None
    fn = getattr(lib, f"banyan_fp8_{verb}_rows_{name}")
    fn.argtypes = _FP8_ARGS[verb]
    fn.restype = None
    return fn


def fp8_dequantize_rows(codes: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype
                        ) -> torch.Tensor | None:
    """mem/kv_pool.dequantize_rows for fp8 codes [..., D] (D % 16 == 0) and their scales
    [...] (None: 1 each) into float32 or bfloat16, in one native call (cpu_kv_quant.cpp), bit
    for bit the torch composition's; None where the kernel cannot run."""
    fn = _fp8_rows("dequantize", codes.dtype)
    d = codes.shape[-1] if codes.dim() else 0
    if fn is None or codes.device.type != "cpu" or d == 0 or d % 16 or \
            dtype not in (torch.float32, torch.bfloat16):
        return None
    c = codes.contiguous()
    s = None if scale is None else scale.float().contiguous()
    out = torch.empty(codes.shape, dtype=dtype)
    with native.kernel_range("banyan::fp8_dequantize_rows"):
        fn(c.data_ptr(), native.data_ptr(s), c.numel() // d, d, out.data_ptr(),
           int(dtype == torch.bfloat16), torch.get_num_threads())
    return out


def fp8_quantize_rows(x: torch.Tensor, code_dtype: torch.dtype, shifts: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """mem/kv_pool.quantize_rows's fp8 rule in one native call (cpu_kv_quant.cpp): x [..., D]
    -> (codes [..., D] code_dtype, scales [...] float32), bit for bit the torch composition's;
    shifts: the scale shifts tried, float32. None where the kernel cannot run."""
    fn = _fp8_rows("quantize", code_dtype)
    if fn is None or x.device.type != "cpu" or x.dim() == 0 or x.shape[-1] == 0:
        return None
    xf = x.float().contiguous()
    d = x.shape[-1]
    rows = xf.numel() // d
    codes = torch.empty(x.shape, dtype=torch.uint8)
    scales = torch.empty(x.shape[:-1], dtype=torch.float32)
    with native.kernel_range("banyan::fp8_quantize_rows"):
        fn(xf.data_ptr(), rows, d, shifts.data_ptr(), shifts.numel(), codes.data_ptr(),
           scales.data_ptr(), torch.get_num_threads())
    return codes.view(code_dtype), scales
