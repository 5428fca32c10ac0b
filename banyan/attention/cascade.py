"""Cascade ("shared-prefix") attention for the torch backend.

With prefix caching, many running requests start with the same KV slots (a shared system prompt:
the radix tree hands every request the same slots for the cached part). The plain path gathers
every request's whole context from the pool and attends it separately, so a 1,024-token prompt
shared by 64 requests is read and multiplied 64 times per layer. Here the attention of each new
token is split at the shared prefix length P of its group (`prefix_groups.py`):

- own part, first: positions [P, prefix + n) of each request (its own cached tail and its new
  tokens, causal), as a padded batch over the requests with a mask, in float32, giving the
  normalised output o_own and the log-sum-exp lse_own of every query;
- prefix part: ONE gather of the group's P prefix slots per layer and ONE unmasked SDPA of all
  the group's queries ([KVH, Bg*n*G] query rows, GQA heads folded into rows) against them;
- merge, exactly: the prefix SDPA gets one extra "virtual" key whose score is lse_own for each
  query (a zero key, plus one spare head-dim column where q carries lse_own / scale and the
  key carries 1) and whose value is the unit vector of that spare column. The softmax over
  prefix + virtual key then weighs the prefix and the own part exactly as one softmax over the
  whole context would: out[:D] is the prefix's share and out[D] = w the own part's weight, so
  attention = out[:D] + w * o_own. No statistics leave SDPA, no score matrix is materialised
  for the prefix, and the fused kernel's max-subtraction keeps it stable whatever the scores.

Every request keeps at least its newest token in its own part (P <= prefix), so the own part
is never empty and lse_own is finite. All the arithmetic is float32 whatever the KV dtype (the
prefix is converted once per layer): bf16 scores or a bf16 unnormalised output would each add a
bf16 rounding (measured: 1.5x the plain path's error); in float32 the result is the exact
attention rounded once. Decodes are the case n = 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from banyan.attention.prefix_groups import SharedPrefix
from banyan.mem.kv_pool import LayerKV


@dataclass(slots=True)
class PrefixGroup:
    """One shared prefix: cascade rows [start, start + count) attend it."""

    start: int
    count: int
    length: int  # P
    kv_index: torch.Tensor  # [KVH * P] int64 head-split rows of the prefix (`head_split`)
    # float32 SDPA operands, head dim D' = D + 1 rounded up to 8 (see `padded_head_dim`); their
    # padding and virtual row are set once per step, each layer rewrites the live part.
    k_buf: torch.Tensor  # [KVH, P + 1, D']: row P is the virtual key
    v_buf: torch.Tensor  # [KVH, P + 1, D']
    # [KVH, count * N * G, D'], made by the step's first layer (the plan does not know G)
    q_buf: torch.Tensor | None = None


@dataclass(slots=True)
class CascadePlan:
    """Per-step plan of the grouped requests ("rows", in group order), each with up to N new
    tokens: N = 1 for the decode cascade, the longest extend for the extend cascade."""

    num_rows: int  # R
    queries: int  # N: new tokens per row, padded
    own_len: int  # Lo: longest own part, new tokens included
    groups: list[PrefixGroup]
    tokens: torch.Tensor  # [V] int64: flat batch index of each real query, row-major
    # [R * N] int64 flat index of the token each padded query copies (pads repeat their row's
    # last token), and [V] positions of the real ones in that layout; None when N == 1.
    q_index: torch.Tensor | None
    valid: torch.Tensor | None
    own_index: torch.Tensor  # [R * KVH * Lo] int64 head-split rows, padded with table entries
    own_mask: torch.Tensor  # [R, 1, N, 1, Lo] bool: True = not visible (padding or future)


def padded_head_dim(head_dim: int) -> int:
    """Head dim of the prefix SDPA: one spare column, rounded up to 8 so CUDA's fused kernels
    accept it (CPU measured 5% slower at 72 than at 65 for D = 64: not worth a special case)."""
    return (head_dim + 1 + 7) // 8 * 8


def head_split(slots: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """slots: [..., L] -> [..., KVH, L] int64 row indices into a [slots * KVH, D] view of a pool
    layer: gathering them yields each KV head's [L, D] block contiguous, so the batched matmuls
    need no transposing copy."""
    heads = torch.arange(kv_heads, dtype=torch.int64, device=slots.device)
    return slots.to(torch.int64).unsqueeze(-2) * kv_heads + heads[:, None]


def plan_cascade(
    table: torch.Tensor,
    kv_heads: int,
    head_dim: int,
    groups: list[SharedPrefix],
    rows: list[int],
    prefix_lens: list[int],
    extend_lens: list[int],
    token_starts: list[int],
) -> CascadePlan:
    """Index tensors and buffers for the grouped requests. rows/prefix_lens/extend_lens/
    token_starts: per request, indexed by `SharedPrefix.members` (token_starts: the request's
    first new token in the flat batch)."""
    device = table.device
    order = [i for g in groups for i in g.members]
    shared = [g.length for g in groups for _ in g.members]  # P of each row's group
    ns = [extend_lens[i] for i in order]
    own = [prefix_lens[i] - p + n for i, p, n in zip(order, shared, ns, strict=True)]
    R, N, lo = len(order), max(ns), max(own)
    Dp = padded_head_dim(head_dim)

    # Own part: table columns [P, P + Lo) of each row; padding columns clamped into the table
    # (they read some slot's finite K/V, masked out).
    rows_t = torch.tensor([rows[i] for i in order], dtype=torch.int64).to(device)
    shared_t = torch.tensor(shared, dtype=torch.int64).to(device)
    cols = (shared_t[:, None] + torch.arange(lo, device=device)[None, :]).clamp_(
        max=table.shape[1] - 1
    )  # [R, Lo]
    own_index = head_split(table[rows_t[:, None], cols], kv_heads).reshape(-1)
    # Query t of a row sees own keys j <= lo_r - n_r + t; pad queries (t >= n_r) see the whole
    # own part (finite, discarded).
    own_t = torch.tensor(own, dtype=torch.int64).to(device)
    n_t = torch.tensor(ns, dtype=torch.int64).to(device)
    t = torch.arange(N, device=device)
    last = torch.minimum(own_t[:, None] - n_t[:, None] + t[None, :], own_t[:, None] - 1)
    own_mask = torch.arange(lo, device=device)[None, None, :] > last[:, :, None]  # [R, N, Lo]

    starts = [token_starts[i] for i in order]
    tokens = torch.tensor(
        [s + j for s, n in zip(starts, ns, strict=True) for j in range(n)], dtype=torch.int64
    ).to(device)
    q_index = valid = None
    if N > 1:
        q_index = torch.tensor(
            [s + min(j, n - 1) for s, n in zip(starts, ns, strict=True) for j in range(N)],
            dtype=torch.int64,
        ).to(device)
        valid = torch.tensor(
            [r * N + j for r, n in enumerate(ns) for j in range(n)], dtype=torch.int64
        ).to(device)

    plan_groups: list[PrefixGroup] = []
    start = 0
    for g in groups:
        bg, p = len(g.members), g.length
        kv_index = head_split(table[rows[g.members[0]], :p], kv_heads).reshape(-1)
        k_buf = torch.zeros((kv_heads, p + 1, Dp), dtype=torch.float32, device=device)
        v_buf = torch.zeros((kv_heads, p + 1, Dp), dtype=torch.float32, device=device)
        k_buf[:, p, head_dim] = 1.0  # virtual key: score = scale * q[D] = lse_own
        v_buf[:, p, head_dim] = 1.0  # its value: the unit vector of the spare column
        plan_groups.append(PrefixGroup(start, bg, p, kv_index, k_buf, v_buf))
        start += bg
    return CascadePlan(
        R, N, lo, plan_groups, tokens, q_index, valid, own_index, own_mask.view(R, 1, N, 1, lo)
    )


def cascade_attention(
    q: torch.Tensor,
    layer: LayerKV,
    plan: CascadePlan,
    scale: float,
    ws: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """q: [T, H, D] the step's queries (flat); layer: the pool's layer ([slots, KVH, D]); ws:
    workspaces (K, V in the model's dtype; K, V in float32, the same two when it is float32)
    of >= max(R * Lo, max P) rows of [KVH, D] -> [V, H, D] for `plan.tokens`."""
    H, D = q.shape[1], q.shape[2]
    kvh = layer.k.shape[1]
    G = H // kvh
    R, N, lo = plan.num_rows, plan.queries, plan.own_len
    ws_k, ws_v, wf_k, wf_v = ws

    # Queries as [R, KVH, N*G, D] float32: a row's N tokens x G heads of a KV head.
    qsel = q.index_select(0, plan.tokens if plan.q_index is None else plan.q_index)
    qf = torch.empty((R, kvh, N * G, D), dtype=torch.float32, device=q.device)
    qf.view(R, kvh, N, G, D).copy_(qsel.view(R, N, kvh, G, D).transpose(1, 2))

    # (a) own parts: [R*KVH, Lo, D] blocks, scores [R, KVH, N*G, Lo]
    ks = _gather(layer, 0, plan.own_index, ws_k, wf_k).view(R * kvh, lo, D)
    vs = _gather(layer, 1, plan.own_index, ws_v, wf_v).view(R * kvh, lo, D)
    s = torch.empty((R * kvh, N * G, lo), dtype=torch.float32, device=q.device)
    s.baddbmm_(qf.view(R * kvh, N * G, D), ks.transpose(1, 2), beta=0, alpha=scale)
    s.view(R, kvh, N, G, lo).masked_fill_(plan.own_mask, float("-inf"))
    m = s.amax(-1, keepdim=True)  # finite: every query sees at least one own key
    p = s.sub_(m).exp_()
    l_ = p.sum(-1, keepdim=True)
    o = torch.bmm(p, vs).div_(l_).view(R, kvh, N * G, D)  # normalised own-part output
    lse = l_.log_().add_(m).view(R, kvh, N * G, 1)

    # (b) shared prefixes: one SDPA per group, merged through the virtual key, in place in o.
    for grp in plan.groups:
        r0, r1, bg, pl = grp.start, grp.start + grp.count, grp.count, grp.length
        k_live, v_live = grp.k_buf[:, :pl, :D], grp.v_buf[:, :pl, :D]
        k_live.copy_(_gather_raw(layer, 0, grp.kv_index, ws_k).view(kvh, pl, D))
        v_live.copy_(_gather_raw(layer, 1, grp.kv_index, ws_v).view(kvh, pl, D))
        if grp.q_buf is None:
            shape = (kvh, bg * N * G, grp.k_buf.shape[-1])
            grp.q_buf = torch.zeros(shape, dtype=torch.float32, device=q.device)
        qb = grp.q_buf.view(kvh, bg, N * G, -1)
        qb[..., :D].copy_(qf[r0:r1].transpose(0, 1))
        qb[..., D : D + 1].copy_(lse[r0:r1].transpose(0, 1)).div_(scale)
        out = F.scaled_dot_product_attention(
            grp.q_buf.unsqueeze(0), grp.k_buf.unsqueeze(0), grp.v_buf.unsqueeze(0), scale=scale
        )[0]  # [KVH, Bg*N*G, D']
        out = out.view(kvh, bg, N * G, -1).transpose(0, 1)  # [Bg, KVH, N*G, D']
        o[r0:r1].mul_(out[..., D : D + 1]).add_(out[..., :D])

    if N == 1:
        return o.view(R, H, D).to(q.dtype)
    assert plan.valid is not None
    res = o.view(R, kvh, N, G, D).transpose(1, 2).reshape(R * N, H, D)
    return res.index_select(0, plan.valid).to(q.dtype)


def _gather_raw(layer: LayerKV, which: int, index: torch.Tensor, ws: torch.Tensor
                ) -> torch.Tensor:
    """K (which 0) or V (1) rows of the layer's [slots * KVH, D] head-split view; index: [N]
    -> [N, D] in the model's dtype, written into the workspace ws."""
    return layer.select(which, index, ws.view(-1, ws.shape[-1]), head_rows=True)


def _gather(
    layer: LayerKV, which: int, index: torch.Tensor, ws: torch.Tensor, wf: torch.Tensor
) -> torch.Tensor:
    """As `_gather_raw`, in float32 into the float32 workspace wf (staged through ws when the
    model's dtype is not float32; a quantized pool dequantizes straight into float32).
    Workspaces, not fresh tensors: on CPU a fresh multi-MB buffer per layer is mostly page
    faults (measured: the bf16 -> float32 copy 10x slower than into a kept one)."""
    out = wf.view(-1, wf.shape[-1])
    if wf.data_ptr() == ws.data_ptr() or layer.k.dtype != ws.dtype:  # (codes: dequantized)
        return layer.select(which, index, out, head_rows=True)
    return out[: index.shape[0]].copy_(_gather_raw(layer, which, index, ws))
