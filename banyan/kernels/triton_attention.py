"""Triton attention kernels over the paged KV pool (the GPU path; on CPU they run only under
Triton's interpreter, TRITON_INTERPRET=1, which is how the tests check them).

Both kernels read K/V in place: a request's position p lives at slot `table[row, p]` of the
layer's K and V tensors ([num_slots, kv_heads, head_dim], contiguous). Nothing is gathered into
a workspace first. Scores are kept in base 2 (the scale is multiplied by log2(e) once, so the
online softmax uses exp2), accumulation is float32, and the output is rounded to q's dtype once.

- Decode (one new token per request): split-K in two stages. Stage 1 gives each (request, KV
  head, split) a program that walks its share of the context through the table and writes the
  normalized partial output and its log-sum-exp for the G query heads of that KV head (GQA:
  the G heads are the rows of one tile, so each K/V block is loaded once for all of them).
  Stage 2 merges the splits of each (request, head) exactly by their log-sum-exps. Splits let
  a few long contexts fill the GPU; the split count is one number per step (the backend picks
  it), and each request cuts its own context into that many block-aligned pieces, so a short
  request's surplus splits are empty programs.
- Extend (a prefill chunk or speculative check of n tokens over a cached prefix): one program
  per (BLOCK_M new tokens, query head) walks the row's positions up to its last token through
  the table (the layer stores the new tokens' K/V first), new token j seeing the whole prefix
  and new tokens 0..j.

Both run the same loop (`_attend`): a query tile whose rows each see positions up to their
own last one; the decode tile's rows are the G heads of a KV head, the extend tile's are tokens.

A quantized pool (`--kv-cache-dtype int8|fp8_e4m3|fp8_e5m2`: one-byte codes, a float32 scale per
(slot, KV head) row) is read in place too, as the CPU kernel reads it: the codes go to the
query's dtype as they are (int8 and fp8 codes are exact in bf16 and fp16), each key's scale
multiplies its scores and each value's scale its probabilities, so no dequantized copy of a
block is made. fp8 bytes are decoded with integer operations into float16 (e5m2 is float16's
top byte; e4m3's seven low bits sit where float16's exponent and mantissa start, 2^-8 of the
value, which the scale makes up): the same instructions on a GPU and in the interpreter.

The interpreter computes bfloat16 matrix products wrongly (numpy has no bfloat16), so under it
the operands of bf16 products are upcast to float32 (`UPCAST`); on a GPU they stay bf16 and run
on tensor cores. float32 products use IEEE precision, not TF32: a float32 model is meant to
match transformers' float32 token for token.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

try:
    INTERPRETED = bool(triton.knobs.runtime.interpret)
except AttributeError:  # an older triton (a CUDA torch may bring one): no knobs yet
    INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
LOG2E = 1.4426950408889634
MAX_GROUP_BLOCK = 64  # query heads of one KV head in one decode tile (more: several programs)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def head_block(head_dim: int) -> int:
    """The padded head dimension of a tile: a power of two, >= 16 (tl.dot's smallest K)."""
    return max(16, _pow2(head_dim))


def extend_blocks(head_dim: int) -> tuple[int, int]:
    """(BLOCK_M new tokens, BLOCK_N keys) of an extend tile. 64 x 64 keeps a float32 tile pair
    with head_dim <= 128 within a GPU's registers; wider heads halve both (a common choice for
    such kernels, not tuned on hardware here)."""
    return (64, 64) if head_block(head_dim) <= 128 else (32, 32)


DECODE_BLOCK_N = 64  # keys per decode step of the loop; also a split's granularity


def decode_tile(group: int) -> tuple[int, int]:
    """(BLOCK_H query heads of a decode tile, programs per KV head) for G query heads per KV
    head: a tile of >= 16 rows (tl.dot's smallest M), several programs past MAX_GROUP_BLOCK."""
    block_h = min(max(16, _pow2(group)), MAX_GROUP_BLOCK)
    return block_h, triton.cdiv(group, block_h)


def dot_flags(dtype: torch.dtype, interpreted: bool = INTERPRETED) -> tuple[bool, str | None]:
    """(UPCAST, input precision) of the products for K/V of this dtype (see the module doc)."""
    upcast = interpreted and dtype == torch.bfloat16
    return upcast, ("ieee" if dtype == torch.float32 else None)


# ---------------------------------------------------------------------------- shared loop

# QUANT: how the pool holds K/V (a constexpr of the kernels; globals they read must be one)
PLAIN, INT8, FP8_E4M3, FP8_E5M2 = (tl.constexpr(i) for i in range(4))
QUANT_OF = {torch.int8: INT8.value, torch.float8_e4m3fn: FP8_E4M3.value,
            torch.float8_e5m2: FP8_E5M2.value}


@triton.jit
def _code_values(c, QUANT: tl.constexpr):
    """A block of codes (int8, or fp8 bytes read as uint8) -> float32 values before the row
    scale (e4m3's at 2^-8 of themselves: _attend's scales make up for it)."""
    if QUANT == INT8:
        return c.to(tl.float32)
    bits = c.to(tl.int32)
    if QUANT == FP8_E4M3:  # sign to float16's; exponent and mantissa to the top of theirs
        half = ((bits & 0x80) << 8) | ((bits & 0x7F) << 7)
    else:  # e5m2: float16's top byte
        half = bits << 8
    return half.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _attend(q, k_base, v_base, ks_base, vs_base, table_row, stride_s, stride_ss, lo, hi, last,
            scale_log2, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
            d_mask, UPCAST: tl.constexpr, PRECISION: tl.constexpr, QUANT: tl.constexpr):
    """Online softmax of a [ROWS, BLOCK_D] query tile over positions [lo, hi) of one table
    row, row r seeing positions <= last[r] (< hi) -> (running max m, sum l, output sum acc),
    float32, scores in base 2. k_base/v_base: the KV head's [1, BLOCK_D] pointers into the
    pool, slot s at + s * stride_s; a quantized pool's (QUANT) row scales at ks_base/vs_base
    + s * stride_ss. An empty range leaves m = -inf, l = 0."""
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_mask = pos < hi
        # masked positions read slot 0 (the padding slot: always finite), never stale entries
        slots = tl.load(table_row + pos, mask=pos_mask, other=0).to(tl.int64)
        offset = slots[:, None] * stride_s
        kv_mask = pos_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + offset, mask=kv_mask, other=0)
        v = tl.load(v_base + offset, mask=kv_mask, other=0)
        if QUANT != PLAIN:  # codes in q's dtype (exact there), the scales kept aside
            k = _code_values(k, QUANT).to(q.dtype)
            v = _code_values(v, QUANT).to(q.dtype)
            k_scale = tl.load(ks_base + slots * stride_ss, mask=pos_mask, other=0.0)
            v_scale = tl.load(vs_base + slots * stride_ss, mask=pos_mask, other=0.0)
            if QUANT == FP8_E4M3:  # (_code_values left its values at 2^-8 of themselves)
                k_scale = k_scale * 256.0
                v_scale = v_scale * 256.0
        elif UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        if QUANT != PLAIN:  # each key's scale times its scores
            qk = qk * k_scale[None, :]
        qk = tl.where(pos[None, :] <= last[:, None], qk, float("-inf"))
        # Every row sees position lo (last >= lo), so m_new is finite from the first block
        # on, and a row whose later block is all masked adds exp2(-inf) = 0.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        pv = p
        if QUANT != PLAIN:  # each value's scale times its probabilities
            pv = p * v_scale[None, :]
        acc = acc * alpha[:, None] + tl.dot(pv.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@dataclass(frozen=True, slots=True)
class PoolView:
    """How the kernels read a layer's pool: K/V as they load them (fp8 codes as bytes), the row
    scales (the pools themselves, never read, when unquantized) with their slot stride, and the
    constexprs that go with them (QUANT, UPCAST, PRECISION)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    stride_ss: int
    consts: dict[str, object]

    @classmethod
    def of(cls, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
           k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> PoolView:
        if k_pool.shape != v_pool.shape or k_pool.stride() != v_pool.stride() \
                or k_pool.stride(-1) != 1:  # the kernels address K and V with one set of strides
            raise ValueError("K and V pools must be alike, with contiguous head rows")
        quant = QUANT_OF.get(k_pool.dtype, PLAIN.value)
        if quant == PLAIN.value:
            upcast, precision = dot_flags(k_pool.dtype)
            return cls(k_pool, v_pool, k_pool, v_pool, 0,
                       dict(QUANT=quant, UPCAST=upcast, PRECISION=precision))
        if k_scale is None and v_scale is None and quant != INT8.value:
            # fp8 with one unit scale for the pool (kv_pool.UNIT_SCALE_NAMES): a head's scale
            # row read for every slot (slot stride 0)
            k_scale = v_scale = _unit_scales(k_pool.shape[1], k_pool.device)
            stride_ss = 0
        elif k_scale is None or v_scale is None or k_scale.shape != k_pool.shape[:2] \
                or v_scale.shape != k_scale.shape or k_scale.stride() != v_scale.stride() \
                or k_scale.stride(-1) != 1:
            raise ValueError("a quantized pool needs its K and V scales, [slots, KV heads] alike")
        else:
            stride_ss = k_scale.stride(0)
        upcast, precision = dot_flags(q.dtype)  # the codes go to q's dtype
        read_as = torch.int8 if quant == INT8.value else torch.uint8
        return cls(k_pool.view(read_as), v_pool.view(read_as), k_scale, v_scale,
                   stride_ss, dict(QUANT=quant, UPCAST=upcast, PRECISION=precision))


@functools.cache
def _unit_scales(kv_heads: int, device: torch.device) -> torch.Tensor:
    return torch.ones(kv_heads, dtype=torch.float32, device=device)


# ---------------------------------------------------------------------------- decode


# num_splits changes from step to step: specialised (Triton's default for integers: == 1, a
# multiple of 16) it would compile a kernel variant in the middle of serving (~1 s each).
@triton.jit(do_not_specialize=["num_splits"])
def _decode_split_kernel(
    Q, K, V, KS, VS, Table, Rows, SeqLens, Tokens, MidO, MidLse,
    scale_log2, num_splits,
    stride_qt, stride_qh, stride_s, stride_h, stride_ss, stride_tr,
    stride_mo_b, stride_mo_h, stride_mo_s, stride_ml_b, stride_ml_h,
    GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, QUANT: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    first = (tl.program_id(1) % HEAD_BLOCKS) * BLOCK_H  # of the group's heads
    split = tl.program_id(2)
    row = tl.load(Rows + b).to(tl.int64)
    seq_len = tl.load(SeqLens + b)
    token = tl.load(Tokens + b).to(tl.int64)
    # Block-aligned splits: every split but the last full, surplus ones empty.
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)

    in_group = first + tl.arange(0, BLOCK_H)
    head_mask = in_group < GROUP
    heads = kv_head * GROUP + in_group
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(Q + token * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=head_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    last = tl.full([BLOCK_H], 0, tl.int32) + (hi - 1)  # no causality within a split
    m_i, l_i, acc = _attend(q, K + kv_head * stride_h + d[None, :],
                            V + kv_head * stride_h + d[None, :], KS + kv_head, VS + kv_head,
                            Table + row * stride_tr, stride_s, stride_ss, lo, hi, last,
                            scale_log2, BLOCK_H, BLOCK_N, BLOCK_D, d_mask, UPCAST, PRECISION,
                            QUANT)
    filled = l_i > 0  # an empty split (lo >= hi) leaves l_i = 0: weight 0 in the merge
    safe_l = tl.where(filled, l_i, 1.0)
    out = tl.where(filled[:, None], acc / safe_l[:, None], 0.0)
    lse = tl.where(filled, m_i + tl.log2(safe_l), float("-inf"))
    tl.store(MidO + b * stride_mo_b + heads[:, None] * stride_mo_h + split * stride_mo_s
             + d[None, :], out, mask=head_mask[:, None] & d_mask[None, :])
    tl.store(MidLse + b * stride_ml_b + heads * stride_ml_h + split, lse, mask=head_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    MidO, MidLse, Tokens, Out, num_splits,
    stride_mo_b, stride_mo_h, stride_mo_s, stride_ml_b, stride_ml_h, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_mask = s < num_splits
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    lse = tl.load(MidLse + b * stride_ml_b + h * stride_ml_h + s, mask=s_mask,
                  other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))  # split 0 is never empty: the max is finite
    part = tl.load(MidO + b * stride_mo_b + h * stride_mo_h + s[:, None] * stride_mo_s
                   + d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(weight[:, None] * part, 0) / tl.sum(weight, 0)
    token = tl.load(Tokens + b).to(tl.int64)
    tl.store(Out + token * stride_ot + h * stride_oh + d, out.to(Out.dtype.element_ty),
             mask=d_mask)


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    tokens: torch.Tensor,
    mid_o: torch.Tensor,
    mid_lse: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """out[tokens[b]] = attention of q[tokens[b]] over positions [0, seq_lens[b]) of table row
    rows[b]. q/out: [T, H, D]; k/v_pool: [slots, KVH, D] (codes, with k/v_scale [slots, KVH]
    float32, for a quantized pool); rows/seq_lens/tokens: [B] int32; mid_o: [B, H, S, D] and
    mid_lse: [B, H, S] float32 scratch, S being the split count."""
    pool = PoolView.of(q, k_pool, v_pool, k_scale, v_scale)
    batch, heads, splits = mid_lse.shape
    kv_heads, head_dim = k_pool.shape[1], k_pool.shape[2]
    group = heads // kv_heads
    block_h, head_blocks = decode_tile(group)
    block_d = head_block(head_dim)
    _decode_split_kernel[(batch, kv_heads * head_blocks, splits)](
        q, pool.k, pool.v, pool.k_scale, pool.v_scale, table, rows, seq_lens, tokens, mid_o,
        mid_lse, scale * LOG2E, splits,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), pool.stride_ss,
        table.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, HEAD_BLOCKS=head_blocks, HEAD_DIM=head_dim, BLOCK_H=block_h,
        BLOCK_N=DECODE_BLOCK_N, BLOCK_D=block_d, **pool.consts, num_warps=4, num_stages=2,
    )
    _decode_merge_kernel[(batch, heads)](
        mid_o, mid_lse, tokens, out, splits,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_S=_pow2(splits), BLOCK_D=block_d, num_warps=4,
    )


# ---------------------------------------------------------------------------- extend


@triton.jit
def _extend_kernel(
    Q, K, V, KS, VS, Table, BlockReq, BlockStart, ReqRow, ReqPrefix, ReqLen, ReqToken, Out,
    scale_log2,
    stride_qt, stride_qh, stride_s, stride_h, stride_ss, stride_tr, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, QUANT: tl.constexpr,
):
    blk = tl.program_id(0)
    h = tl.program_id(1)
    kv_head = h // GROUP
    r = tl.load(BlockReq + blk)
    m0 = tl.load(BlockStart + blk)  # first new token of this block, within the request
    row = tl.load(ReqRow + r).to(tl.int64)
    prefix = tl.load(ReqPrefix + r)
    n = tl.load(ReqLen + r)
    token0 = tl.load(ReqToken + r).to(tl.int64)  # the request's first token in the batch

    m = m0 + tl.arange(0, BLOCK_M)
    m_mask = m < n
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(Q + (token0 + m)[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    # New token m (position prefix + m) sees positions [0, prefix + m]: the whole prefix and
    # new tokens 0..m. Nothing past the block's last token is seen by any of its rows; the
    # padding rows past n see what the last real row sees (they are not stored).
    hi = prefix + tl.minimum(n, m0 + BLOCK_M)
    last = tl.minimum(prefix + m, hi - 1)
    m_i, l_i, acc = _attend(q, K + kv_head * stride_h + d[None, :],
                            V + kv_head * stride_h + d[None, :], KS + kv_head, VS + kv_head,
                            Table + row * stride_tr, stride_s, stride_ss, 0, hi, last,
                            scale_log2, BLOCK_M, BLOCK_N, BLOCK_D, d_mask, UPCAST, PRECISION,
                            QUANT)
    out = acc / l_i[:, None]  # l_i > 0: position 0 is visible to every row
    tl.store(Out + (token0 + m)[:, None] * stride_ot + h * stride_oh + d[None, :],
             out.to(Out.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def extend_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    table: torch.Tensor,
    req_rows: torch.Tensor,
    req_prefix: torch.Tensor,
    req_lens: torch.Tensor,
    req_tokens: torch.Tensor,
    block_req: torch.Tensor,
    block_start: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Extends: request r's req_lens[r] new tokens (flat batch rows req_tokens[r]...) at
    positions req_prefix[r]... of table row req_rows[r], over its cached prefix and causally
    over themselves, all read from the pool (the new tokens' K/V are stored already).
    block_req/block_start: [NB] int32, one entry per BLOCK_M new tokens (`extend_blocks`);
    k/v_scale: a quantized pool's, as decode_attention's."""
    pool = PoolView.of(q, k_pool, v_pool, k_scale, v_scale)
    heads, head_dim = q.shape[1], q.shape[2]
    block_m, block_n = extend_blocks(head_dim)
    _extend_kernel[(block_req.shape[0], heads)](
        q, pool.k, pool.v, pool.k_scale, pool.v_scale, table, block_req, block_start,
        req_rows, req_prefix, req_lens, req_tokens, out, scale * LOG2E,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), pool.stride_ss,
        table.stride(0), out.stride(0), out.stride(1),
        GROUP=heads // k_pool.shape[1], HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=head_block(head_dim), **pool.consts, num_warps=4, num_stages=2,
    )


def split_count(programs: int, longest: int, min_keys: int, max_splits: int,
                target_programs: int) -> int:
    """Splits per decode context: enough that `programs` (decodes x KV heads) x splits reaches
    target_programs, but no split shorter than min_keys of the longest context, and at most
    max_splits."""
    by_length = math.ceil(longest / min_keys)
    by_occupancy = math.ceil(target_programs / max(1, programs))
    return max(1, min(max_splits, by_length, by_occupancy))
