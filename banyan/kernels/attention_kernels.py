"""The native attention kernels' Python entry points (kernels/cpu_paged_attention.cpp: the row
kernel; cpu_prefill_attention.cpp: the prefill kernel), over the library native.load() builds:
pointers and shapes checked and passed, the entry point picked by the queries' and the pool's
types (and, for the prefill kernel, its tile mode)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from banyan.kernels import native
from banyan.kernels.native import (
    _DTYPE_SUFFIX,
    _KV_CODE_SUFFIX,
    kernel_range,
    prefill_tiles,
)


def _attention_entry(kind: str, q: torch.Tensor, pool_k: torch.Tensor,
                     k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                     tensors: tuple[torch.Tensor, ...]) -> Callable[..., None]:
    """The attention entry point banyan_{kind}_{queries}_{pool} for these operands (all
    contiguous; a quantized pool's float32 row scales given, or None for fp8's unit scale)."""
    # (looked up on the module at each call, so that a script pointing native.load at another
    # build, as the A/B benchmarks do, gets that build here too)
    lib = native.load()
    assert lib is not None, "native kernels unavailable: check supports() first"
    quantized = pool_k.dtype != q.dtype
    kv_sfx = _KV_CODE_SUFFIX[pool_k.dtype] if quantized else _DTYPE_SUFFIX[q.dtype]
    if quantized and k_scale is not None:
        assert v_scale is not None and k_scale.dtype == v_scale.dtype == torch.float32
        tensors += (k_scale, v_scale)
    else:
        assert v_scale is None
    for t in tensors:
        assert t.is_contiguous()
    return getattr(lib, f"banyan_{kind}_{_DTYPE_SUFFIX[q.dtype]}_{kv_sfx}")


def paged_attention(
    q: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    table: torch.Tensor,
    req_row: torch.Tensor,
    req_len: torch.Tensor,
    q_start: torch.Tensor,
    n_new: torch.Tensor,
    order: torch.Tensor,
    group_start: torch.Tensor,
    group_prefix: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the given requests' new tokens over their whole context, read in place
    from the pool. q, out: [T, H, D] contiguous (the step's flat tokens; only the listed requests'
    rows are read and written); pool_k/v: [slots, KVH, D] of one layer; table: [rows, stride]
    int32. Per request (int64 [R]): req_row, req_len (context with its new tokens, all stored),
    q_start (its first token in q), n_new (1 for a decode). order: [R] request indices grouped;
    group_start: [G + 1]; group_prefix: [G] slots every member of the group shares (0 alone).
    A quantized pool (int8 / fp8 codes) comes with k_scale, v_scale: [slots, KVH] float32 (None
    where it keeps no row scales: fp8's unit scale).
    Returns out."""
    fn = _attention_entry("paged_attention", q, pool_k, k_scale, v_scale, (
        q, out, pool_k, pool_v, table, req_row, req_len, q_start, n_new, order, group_start,
        group_prefix))
    _, H, D = q.shape
    with kernel_range("banyan::paged_attention"):
        fn(
            q.data_ptr(), pool_k.data_ptr(), pool_v.data_ptr(),
            native.data_ptr(k_scale), native.data_ptr(v_scale),
            table.data_ptr(), table.shape[1],
            req_row.data_ptr(), req_len.data_ptr(), q_start.data_ptr(), n_new.data_ptr(),
            order.data_ptr(), group_start.data_ptr(), group_prefix.data_ptr(),
            group_prefix.shape[0], out.data_ptr(), H, pool_k.shape[1], D, scale,
            torch.get_num_threads(),
        )
    return out


def prefill_attention(
    q: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    table: torch.Tensor,
    req_row: torch.Tensor,
    req_len: torch.Tensor,
    q_start: torch.Tensor,
    n_new: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    tiles: int = 0,
) -> torch.Tensor:
    """Causal attention of the given requests' new tokens (prefill chunks: blocks of queries
    against blocks of keys, cpu_prefill_attention.cpp) over their whole context, read in place
    from the pool. The arguments are paged_attention's without the grouping: q, out [T, H, D]
    contiguous (only the listed requests' rows are read and written); pool_k/v [slots, KVH, D]
    of one layer; table [rows, stride] int32; per request (int64 [R]) req_row, req_len (context
    with its new tokens, all stored), q_start, n_new; k_scale, v_scale [slots, KVH] float32 for
    a quantized pool. tiles (bf16 queries): 1 the products on tiles emulated in memory (tests),
    2 on AMX's (where prefill_tiles() is 2); 0 the vector paths. Returns out."""
    assert tiles < 2 or prefill_tiles() == 2, "no AMX tiles here (the instructions would fault)"
    fn = _attention_entry(
        "prefill_attention_tiles" if tiles else "prefill_attention", q, pool_k, k_scale,
        v_scale, (q, out, pool_k, pool_v, table, req_row, req_len, q_start, n_new))
    _, H, D = q.shape
    with kernel_range("banyan::prefill_attention"):
        fn(
            q.data_ptr(), pool_k.data_ptr(), pool_v.data_ptr(),
            native.data_ptr(k_scale), native.data_ptr(v_scale),
            table.data_ptr(), table.shape[1],
            req_row.data_ptr(), req_len.data_ptr(), q_start.data_ptr(), n_new.data_ptr(),
            req_row.shape[0], out.data_ptr(), H, pool_k.shape[1], D, scale,
            torch.get_num_threads(), *((tiles == 2,) if tiles else ()),
        )
    return out
