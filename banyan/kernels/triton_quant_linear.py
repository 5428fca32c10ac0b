"""Weight-only quantized linears on CUDA: one Triton kernel for `--quantization int8|int4`
(the GPU path; on CPU it runs only under Triton's interpreter, TRITON_INTERPRET=1, which is how
tests/test_triton_quant_linear.py checks it).

out [M, N] = x [M, K] @ W^T (+ bias), W held as the CPU methods quantize it (layers/quant.py):

- int8: codes [N, K] int8 with one float32 scale per output row. The codes go into the product
  as they are (exact in bf16 and fp16) and each row's sum is multiplied by its scale after the
  sum, as the CPU's bf16 GEMM does.
- int4: codes [N, K / 2] uint8, input k in the low nibble of byte k / 2 when k is even and in
  the high one when odd, with a float16 scale and minimum per `group` inputs: each weight is
  code x scale + minimum in float32, rounded once to x's dtype for the product.

The weights are dequantized tile by tile in registers as they stream in, never into a dense
copy: a decode step reads 1 or ~0.6 bytes per weight instead of 2. Accumulation is float32;
float32 activations multiply in IEEE precision (no TF32), as the attention kernels do.
Block sizes are common choices for such kernels, not tuned on a GPU here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from banyan.kernels.triton_attention import dot_flags

BLOCK_N = 64
BLOCK_K = 64


def block_m(rows: int) -> int:
    """Rows of x per program: 16 (tl.dot's smallest) for decode-sized steps, up to 64."""
    return min(64, max(16, triton.next_power_of_2(rows)))


@triton.jit
def _quant_linear_kernel(
    X, W, Scale, Mins, Bias, Out, M, N, K,
    stride_xm, stride_wn, stride_sn, stride_om,
    INT4: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = m < M
    n_mask = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        x = tl.load(X + m[:, None] * stride_xm + k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
        w_mask = n_mask[:, None] & k_mask[None, :]
        if INT4:
            byte = tl.load(W + n[:, None] * stride_wn + (k // 2)[None, :], mask=w_mask, other=0)
            code = (byte.to(tl.int32) >> ((k % 2) * 4)[None, :]) & 0xF
            at = n[:, None] * stride_sn + (k // GROUP)[None, :]
            scale = tl.load(Scale + at, mask=w_mask, other=0.0).to(tl.float32)
            low = tl.load(Mins + at, mask=w_mask, other=0.0).to(tl.float32)
            w = code.to(tl.float32) * scale + low
        else:
            w = tl.load(W + n[:, None] * stride_wn + k[None, :], mask=w_mask, other=0)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PRECISION)
    if not INT4:  # int8: the row's scale after the sum
        acc = acc * tl.load(Scale + n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(Bias + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Out + m[:, None] * stride_om + n[None, :], acc.to(Out.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def quant_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                 mins: torch.Tensor | None = None, group: int = 0,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (float32, bfloat16 or float16, rows contiguous) times the quantized weight ->
    [M, N] in x's dtype. int8: codes [N, K] int8, scale [N] float32, mins None. int4: codes
    [N, K / 2] uint8, scale and mins [N, K / group] float16."""
    int4 = mins is not None
    n, k = codes.shape[0], x.shape[1]
    if x.dim() != 2 or x.stride(1) != 1 or codes.stride(1) != 1:
        raise ValueError("x must be [M, K] and the codes [N, ...], both with contiguous rows")
    if codes.shape[1] != (k // 2 if int4 else k) or (int4 and (group <= 0 or k % group)):
        raise ValueError(f"codes {tuple(codes.shape)} do not fit {k} inputs "
                         f"({'int4, group ' + str(group) if int4 else 'int8'})")
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    upcast, precision = dot_flags(x.dtype)
    bm = block_m(x.shape[0])
    grid = (triton.cdiv(x.shape[0], bm), triton.cdiv(n, BLOCK_N))
    _quant_linear_kernel[grid](
        x, codes, scale, mins if int4 else scale, bias if bias is not None else scale, out,
        x.shape[0], n, k, x.stride(0), codes.stride(0), scale.stride(0), out.stride(0),
        INT4=int4, GROUP=max(group, 1), HAS_BIAS=bias is not None, BLOCK_M=bm,
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, UPCAST=upcast, PRECISION=precision,
        num_warps=4, num_stages=2,
    )
    return out
