"""Decodes through the native CPU kernel (banyan/kernels/cpu_decode_attention.cpp).

The kernel reads K/V in place from the pool through the table, so a decode step copies no
context at all. Requests sharing a cached prefix are grouped as for the torch cascade
(`prefix_groups.find_shared_prefixes`), but with a much lower bar: in the kernel a group costs
nothing extra, and each shared key is converted once and dotted with all the group's query
rows, so any prefix of `NATIVE_GROUPING.min_prefix` tokens shared by two requests is worth it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from banyan.attention.prefix_groups import CascadePolicy, find_shared_prefixes
from banyan.kernels import native

NATIVE_GROUPING = CascadePolicy(min_prefix=32, min_saved=32)


@dataclass(slots=True)
class NativeDecodePlan:
    """The kernel's per-step arguments for Bd decodes (batch order = `tokens`' order)."""

    tokens: slice | torch.Tensor  # where the decodes' queries sit in the flat batch
    req_row: torch.Tensor  # [Bd] int64 table rows
    req_len: torch.Tensor  # [Bd] int64 context lengths, new token included
    order: torch.Tensor  # [Bd] int64 decode indices, grouped
    group_start: torch.Tensor  # [G + 1] int64
    group_prefix: torch.Tensor  # [G] int64 shared slots of each group (0: alone)


def plan_native_decodes(
    table: torch.Tensor,
    rows: list[int],
    prefix_lens: list[int],
    tokens: list[int],
) -> NativeDecodePlan:
    """rows/prefix_lens/tokens: per decode (table row, tokens already in KV, flat batch index)."""
    n = len(rows)
    groups = find_shared_prefixes(table, rows, prefix_lens, NATIVE_GROUPING) if n >= 2 else []
    grouped = {i for g in groups for i in g.members}
    order: list[int] = []
    starts: list[int] = [0]
    lengths: list[int] = []
    for g in groups:
        order += g.members
        starts.append(len(order))
        lengths.append(g.length)
    for i in range(n):
        if i not in grouped:
            order.append(i)
            starts.append(len(order))
            lengths.append(0)
    first = tokens[0]
    span: slice | torch.Tensor
    if tokens[-1] - first == n - 1:  # contiguous run of tokens (the usual layout)
        span = slice(first, first + n)
    else:
        span = torch.tensor(tokens, dtype=torch.int64)

    def i64(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)

    return NativeDecodePlan(
        span,
        i64(rows),
        i64([p + 1 for p in prefix_lens]),
        i64(order),
        i64(starts),
        i64(lengths),
    )


def native_decode(
    q: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    table: torch.Tensor,
    plan: NativeDecodePlan,
    scale: float,
) -> torch.Tensor:
    """q: [Bd, H, D] the decodes' queries in plan order -> [Bd, H, D]."""
    return native.decode_attention(
        q,
        pool_k,
        pool_v,
        table,
        plan.req_row,
        plan.req_len,
        plan.order,
        plan.group_start,
        plan.group_prefix,
        scale,
    )
