"""Fused element-wise Triton kernels of a decoder layer on the GPU: residual add + RMSNorm,
SiLU-and-mul, RoPE on the fused qkv projection (Qwen3's per-head q/k norms before it). What
the CPU does in cpu_fused_ops.cpp, and why: on an H200 a batch-1 decode step of the 135M model
kept the GPU busy 1.7 ms, most of it ~25 small PyTorch kernels a layer of 1-3 us each (the
norm alone is an add, a cast, the norm, a cast back and the weight's product), and a CUDA
graph of ~800 nodes took 0.68 ms of host time to launch (docs/performance.md, 2026-12-04).
These make it ~3 a layer.

Each rounds where the PyTorch composition rounds, so the values are the same: bf16 products of
two bf16 numbers are exact in float32 and rounded once, as torch's are; the add before the norm
rounds once. Two steps differ in the last bit at most: the norm's sum of squares is reduced in
another order, and exp is another implementation. Floating-point contraction is off, so a float32
a*b - c*d is not turned into an fma that rounds once where torch rounds twice.

Checked on CPU through Triton's interpreter against the PyTorch composition
(tests/test_triton_fused.py) and compiled for sm_90 (tests/triton_hopper.py). Used on CUDA where
BANYAN_TRITON_FUSED=1 (kernels/fused_ops.py dispatches); off by default until a GPU session has
measured them against the PyTorch composition side by side (benchmarks/gpu/batch1_variants.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROPE_BLOCK_MIN = 16


def _warps(block: int) -> int:
    return max(1, min(16, block // 256))


@triton.jit
def _add_rms_norm_kernel(X, R, W, Out, n, eps, stride_x, stride_r, stride_o,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        s = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)  # torch's add: rounded once
        tl.store(R + row * stride_r + cols, s, mask=mask)
    else:
        s = x
    sf = s.to(tl.float32)
    var = tl.sum(sf * sf, 0) / n
    h = (sf * tl.rsqrt(var + eps)).to(x.dtype)  # normalized in float32, cast back (HF's order)
    w = tl.load(W + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * h.to(tl.float32)).to(x.dtype)
    tl.store(Out + row * stride_o + cols, out, mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, n] contiguous. residual += x in place, then its RMSNorm; without a
    residual, x's. -> (normed, the stream: residual or x)."""
    rows, n = x.shape
    out = torch.empty_like(x)
    stream = x if residual is None else residual
    block = triton.next_power_of_2(n)
    _add_rms_norm_kernel[(rows,)](
        x, stream, weight, out, n, eps, x.stride(0), stream.stride(0), out.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_warps(block),
        enable_fp_fusion=False)
    return out, stream


@triton.jit
def _silu_and_mul_kernel(GateUp, Out, inter, stride_g, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(GateUp + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GateUp + row * stride_g + inter + cols, mask=mask, other=0.0)
    act = (g / (1.0 + tl.exp(-g))).to(up.dtype)  # F.silu: in float32, rounded once
    out = (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype)
    tl.store(Out + row * stride_o + cols, out, mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] contiguous (gate columns first) -> silu(gate) * up, [T, I]."""
    rows, width = gate_up.shape
    inter = width // 2
    out = gate_up.new_empty((rows, inter))
    block = min(1024, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](
        gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=block,
        num_warps=_warps(block), enable_fp_fusion=False)
    return out


@triton.jit
def _rope_qk_kernel(QKV, Cos, Sin, QNorm, KNorm, Q, K, stride_t, heads, kv_heads, eps,
                    HALF: tl.constexpr, BLOCK: tl.constexpr, HEAD_NORMS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)  # q heads first, then k heads
    j = tl.arange(0, BLOCK)
    mask = j < HALF
    c = tl.load(Cos + t * HALF + j, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(Sin + t * HALF + j, mask=mask, other=0.0).to(tl.float32)
    src = QKV + t * stride_t + h * (2 * HALF)
    x1 = tl.load(src + j, mask=mask, other=0.0)
    x2 = tl.load(src + HALF + j, mask=mask, other=0.0)
    dt = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if HEAD_NORMS:  # Qwen3: each head RMS-normed before the rotation, as RMSNorm rounds it
        if h < heads:
            w = QNorm
        else:
            w = KNorm
        w1 = tl.load(w + j, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w + HALF + j, mask=mask, other=0.0).to(tl.float32)
        inv = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / (2 * HALF) + eps)
        x1 = (w1 * (x1 * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        x2 = (w2 * (x2 * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    # apply_rotary's ops, each rounded to the model's dtype as torch rounds them
    o1 = ((x1 * c).to(dt).to(tl.float32) - (x2 * s).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)).to(dt)
    if h < heads:
        dst = Q + (t * heads + h) * (2 * HALF)
    else:
        dst = K + (t * kv_heads + (h - heads)) * (2 * HALF)
    tl.store(dst + j, o1, mask=mask)
    tl.store(dst + HALF + j, o2, mask=mask)


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
            kv_heads: int, head_dim: int, q_norm: torch.Tensor | None = None,
            k_norm: torch.Tensor | None = None,
            eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv: [T, >= (H + KVH) D] with unit column stride; cos/sin: [T, D/2] contiguous in its
    dtype -> rotated q [T, H, D] and k [T, KVH, D], contiguous (NeoX/HF half layout).
    q_norm/k_norm: per-head RMSNorm weights [D] applied first (Qwen3), both or neither."""
    rows = qkv.shape[0]
    q = qkv.new_empty((rows, heads, head_dim))
    k = qkv.new_empty((rows, kv_heads, head_dim))
    half = head_dim // 2
    norms = q_norm is not None and k_norm is not None
    unused = cos  # any pointer of the dtype: HEAD_NORMS=False compiles the loads away
    _rope_qk_kernel[(rows, heads + kv_heads)](
        qkv, cos, sin, q_norm if norms else unused, k_norm if norms else unused, q, k,
        qkv.stride(0), heads, kv_heads, eps, HALF=half,
        BLOCK=max(ROPE_BLOCK_MIN, triton.next_power_of_2(half)), HEAD_NORMS=norms,
        num_warps=1, enable_fp_fusion=False)
    return q, k
