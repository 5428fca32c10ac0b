"""The fused element-wise CPU kernels (banyan/kernels/cpu_fused_ops.cpp) against the PyTorch
compositions they replace: the residual add + RMSNorm, SiLU-and-mul, RoPE on the fused qkv rows
(with Qwen3's q/k norms). bf16 must round where torch rounds (after every op), so results are
identical except, rarely, one bf16 step where a float32 sum or exp differs in its last bit;
float32 agrees to a few ulps. Row widths that are not a multiple of the 16-lane vectors and row
counts on both sides of the kernels' threading threshold are covered."""

from __future__ import annotations

import pytest
import torch

from banyan.kernels import fused_ops, native
from banyan.layers.activation import silu_and_mul
from banyan.layers.norm import RMSNorm
from banyan.layers.rotary import apply_rotary

pytestmark = pytest.mark.skipif(
    native.load() is None, reason="native CPU kernels unavailable (no C++ compiler?)"
)

DTYPES = [torch.float32, torch.bfloat16]
ROWS = [1, 7, 300]  # 300 rows of these widths cross the threading threshold


def assert_near(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """float32: within a few ulps. bf16: equal but for rare one-step roundings."""
    assert got.shape == ref.shape and got.dtype == ref.dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=4e-6, atol=1e-6)
        return
    differ = (got != ref) & (ref.float().abs() > 1e-30)  # not where both are ~0
    assert differ.float().mean().item() < 1e-3, f"{differ.sum().item()} of {ref.numel()} differ"
    # One bf16 step at ref's magnitude, two where a result is rounded twice (norm, then RoPE):
    # torch's own bf16 ops round differently on CPUs without AVX512_BF16 (Skylake-X measured
    # 1 element of 25,600 two steps away there).
    step = ref.float().abs() * 2.0**-7 + 1e-30
    assert bool(((got.float() - ref.float()).abs() <= 2 * step).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [576, 100])
def test_add_rms_norm_matches_torch(dtype: torch.dtype, rows: int, width: int) -> None:
    g = torch.Generator().manual_seed(rows + width)
    norm = RMSNorm(width, 1e-5).to(dtype)
    norm.weight.data = torch.randn(width, generator=g).to(dtype)
    x = (torch.randn(rows, width, generator=g) * 3).to(dtype)
    residual = torch.randn(rows, width, generator=g).to(dtype)
    with torch.inference_mode():
        ref_stream = residual + x
        ref = norm(ref_stream)
        fused = fused_ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        assert fused is not None
        out, stream = fused
        assert stream is residual  # updated in place
        assert torch.equal(stream, ref_stream)  # the add rounds exactly like torch's
        assert_near(out, ref, dtype)
        # no residual: the norm of x alone, x returned as the stream
        plain = fused_ops.add_rms_norm(x, None, norm.weight, norm.eps)
        assert plain is not None and plain[1] is x
        assert_near(plain[0], norm(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [1536, 40])
def test_silu_and_mul_matches_torch(dtype: torch.dtype, rows: int, width: int) -> None:
    g = torch.Generator().manual_seed(rows * width)
    gate_up = (torch.randn(rows, 2 * width, generator=g) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's clamped range and zero
    gate, up = gate_up.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    got = fused_ops.silu_and_mul(gate_up)
    assert got is not None
    assert_near(got, ref, dtype)
    assert got[0, 0].float().abs().item() < 1e-38  # silu(-100) * up: ~0, as in torch
    assert torch.equal(silu_and_mul(gate_up), got)  # the layer takes the kernel


def rope_inputs(
    rows: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # qkv rows strided inside a wider buffer, like a slice of a bigger projection
    wide = torch.randn(rows, (heads + 2 * kv_heads) * dim + 8, generator=g).to(dtype)
    qkv = wide[:, : (heads + 2 * kv_heads) * dim]
    positions = torch.randint(0, 5000, (rows,), generator=g)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return qkv, freqs.cos().to(dtype), freqs.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 1, 24), (2, 2, 128)])
def test_rope_matches_torch_exactly(
    dtype: torch.dtype, rows: int, heads: int, kv_heads: int, dim: int
) -> None:
    qkv, cos, sin = rope_inputs(rows, heads, kv_heads, dim, dtype, seed=rows + dim)
    assert qkv.stride(0) > qkv.shape[1]  # rows strided
    q_size, kv_size = heads * dim, kv_heads * dim
    ref_q = apply_rotary(qkv[:, :q_size].reshape(rows, heads, dim), cos, sin)
    ref_k = apply_rotary(qkv[:, q_size : q_size + kv_size].reshape(rows, kv_heads, dim), cos, sin)
    fused = fused_ops.rope_qk(qkv, cos, sin, heads, kv_heads, dim)
    assert fused is not None
    q, k = fused
    assert q.is_contiguous() and k.is_contiguous()
    # products and sums rounded one by one: bit-identical, in float32 too
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_with_qk_norm_matches_torch(dtype: torch.dtype) -> None:
    heads, kv_heads, dim, rows = 8, 2, 64, 50
    qkv, cos, sin = rope_inputs(rows, heads, kv_heads, dim, dtype, seed=3)
    g = torch.Generator().manual_seed(4)
    q_norm, k_norm = RMSNorm(dim, 1e-6).to(dtype), RMSNorm(dim, 1e-6).to(dtype)
    q_norm.weight.data = torch.randn(dim, generator=g).to(dtype)
    k_norm.weight.data = torch.randn(dim, generator=g).to(dtype)
    q_size, kv_size = heads * dim, kv_heads * dim
    with torch.inference_mode():
        ref_q = apply_rotary(q_norm(qkv[:, :q_size].reshape(rows, heads, dim)), cos, sin)
        ref_k = qkv[:, q_size : q_size + kv_size].reshape(rows, kv_heads, dim)
        ref_k = apply_rotary(k_norm(ref_k), cos, sin)
        fused = fused_ops.rope_qk(
            qkv, cos, sin, heads, kv_heads, dim, q_norm.weight, k_norm.weight, 1e-6
        )
    assert fused is not None
    assert_near(fused[0], ref_q, dtype)
    assert_near(fused[1], ref_k, dtype)


def test_inputs_the_kernels_do_not_take_fall_back() -> None:
    half = torch.randn(4, 64).half()
    w = torch.ones(64).half()
    assert fused_ops.add_rms_norm(half, None, w, 1e-5) is None
    assert fused_ops.silu_and_mul(half) is None
    x = torch.randn(4, 64)
    assert fused_ops.add_rms_norm(x, None, torch.ones(64).bfloat16(), 1e-5) is None  # dtypes
    assert fused_ops.silu_and_mul(x.t()) is None  # not contiguous
    assert fused_ops.add_rms_norm(x, torch.randn(4, 64).double(), torch.ones(64), 1e-5) is None
    assert fused_ops.add_rms_norm(x, None, torch.ones(32), 1e-5) is None  # weight's size
    assert fused_ops.silu_and_mul(torch.randn(4, 7)) is None  # odd width
    qkv, cos = torch.randn(4, 64), torch.randn(4, 8)
    assert fused_ops.rope_qk(qkv.t().contiguous().t(), cos, cos, 2, 1, 16) is None  # column-major
    assert fused_ops.rope_qk(qkv, cos[:3], cos[:3], 2, 1, 16) is None  # too few cos/sin rows
    assert fused_ops.rope_qk(qkv, cos, cos, 4, 1, 16) is None  # more heads than the row holds
    w = torch.ones(16)
    assert fused_ops.rope_qk(qkv, cos, cos, 2, 1, 16, w, None) is None  # both norms or neither
    assert fused_ops.rope_qk(qkv, cos, cos, 2, 1, 16) is not None
