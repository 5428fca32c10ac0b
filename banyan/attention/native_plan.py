"""Decodes, and extends over a cached prefix, through the native CPU kernels: the row kernel
(banyan/kernels/cpu_paged_attention.cpp) for decodes and short extends, the blocked prefill
kernel (cpu_prefill_attention.cpp) for longer ones.

Both read K/V in place from the pool through the table, so these requests copy no context at
all, and they write each request's rows of the step's output directly. Decodes sharing a cached
prefix are grouped as for the torch cascade (`prefix_groups.find_shared_prefixes`), but with a
much lower bar: in the kernel a group costs nothing extra, and each shared key is read once and
dotted with all the group's query rows. Extends (prefill chunks, causal) each run alone: they
already reuse every key for n queries. Extends of more than `default_max_extend()` tokens go to
the prefill kernel (`plan_prefill`), which multiplies blocks of queries by blocks of keys. On AVX2
CPUs without AVX-512 (Zen 2/3) the row kernel's AVX2 loops take float32 extends of up to
AVX2_NATIVE_EXTEND tokens and the prefill kernel every other extend (measured below); with the
portable loops alone (before them, on Zen 3: 4 / 16 / 64 / 256 tokens over 2,048 cached took
156 / 308 / 868 / 3,819 ms in the row kernel and 112 / 152 / 265 / 1,043 ms through SDPA) the
row kernel takes only decodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from banyan.attention.prefix_groups import CascadePolicy, find_shared_prefixes
from banyan.host_tensors import int64_tensor
from banyan.kernels import attention_kernels, native
from banyan.mem.kv_pool import LayerKV

NATIVE_GROUPING = CascadePolicy(min_prefix=32, min_saved=32)
MAX_NATIVE_EXTEND = 256
# bf16 queries (over a bf16, int8 or fp8 pool) where the prefill kernel runs vdpbf16ps over
# pairs (AVX512-BF16): it overtakes the row kernel from ~8 tokens. One layer of SmolLM2 on Zen 5,
# 2 threads (benchmarks/prefill_attention.py), row -> prefill kernel over 512 / 2,048 cached
# tokens: 8 tokens 0.06 -> 0.05 / 0.15 -> 0.14 ms, 16 tokens 0.08 -> 0.07 / 0.27 -> 0.24, 32
# tokens 0.15 -> 0.11 / 0.51 -> 0.38, 64 tokens 0.33 -> 0.22 / 1.16 -> 0.75; over int8 / fp8
# e4m3 codes (2,048 cached, `--codes`), 8 tokens 0.17 -> 0.12 / 0.16 -> 0.13, 64 tokens 1.13 ->
# 0.69 / 1.14 -> 0.71. The row kernel keeps up to 16, which covers a speculative check of k + 1
# tokens (its grouping and thread split suit one short request, and its rows get a decode's
# bits: native.EXACT_STEP_TOKENS); the layer stack runs both kernels, so the split costs no
# Python.
BF16_PAIRS_EXTEND = native.EXACT_STEP_TOKENS
# On AVX2 CPUs (attend256) extends of up to 16 tokens: whole steps over 2,048 cached tokens on
# Zen 3 (f32 / gguf SmolLM2), SDPA -> kernel: 4 tokens 56 -> 43 / 54 -> 29 ms, 16 tokens 116 ->
# 112 / 98 -> 87 ms, 64 tokens 346 -> 375 / 305 -> 307 ms. 16 is also the longest step the
# native layer stack takes (a speculative check of k + 1 tokens).
AVX2_NATIVE_EXTEND = 16
# Without AVX-512 the prefill kernel beats the row kernel from 4 tokens on. One layer of
# SmolLM2 (9 x 3 heads of 64) on Zen 3, 1 thread, row -> prefill kernel, over 512 / 2,048
# cached tokens: float32 8 tokens 0.35 -> 0.29 / 0.98 -> 0.91 ms, 16 tokens 0.65 -> 0.44 /
# 1.80 -> 1.26 ms; bf16 4 tokens 0.54 -> 0.17 ms (512), 16 tokens 1.95 -> 0.40 / 5.75 -> 1.41
# ms (bf16 has no AVX2 row loops); float32 over fp8_e4m3 / int8 codes, 16 tokens over 2,048:
# 2.10 -> 1.27 / 2.64 -> 1.65 ms. Float32 over float32 or int8 keeps AVX2_NATIVE_EXTEND all
# the same (measured when the native layer stack ran a step only if the row kernel took all of
# it; it now runs the prefill kernel's requests too).

@dataclass(slots=True)
class NativePlan:
    """The kernel's per-step arguments for R requests (int64 [R] unless noted)."""

    num_tokens: int  # new tokens of these requests (== T when they are the whole step)
    req_row: torch.Tensor  # table rows
    req_len: torch.Tensor  # context lengths, new tokens included
    q_start: torch.Tensor  # first new token of each request in the flat batch
    n_new: torch.Tensor  # new tokens of each request (1: a decode)
    order: torch.Tensor  # request indices, grouped
    group_start: torch.Tensor  # [G + 1]
    group_prefix: torch.Tensor  # [G] shared slots of each group (0: alone)


def default_max_extend(dtype: torch.dtype = torch.float32,
                       code_dtype: torch.dtype | None = None) -> int:
    """Longest extend (a prefill chunk, with or without cached tokens) the row kernel should
    take on this machine for a pool of this compute dtype and these K/V codes (None: the dtype
    itself); longer ones go to the prefill kernel. BF16_PAIRS_EXTEND for bf16 queries where
    the prefill kernel has its pair path, else MAX_NATIVE_EXTEND with the AVX-512 paths;
    with the AVX2 ones AVX2_NATIVE_EXTEND for float32 over float32 or int8 (the native layer
    stack's steps); else 1 (decodes only: see above)."""
    bits = native.vector_bits()
    if bits == 512 and dtype == torch.bfloat16 and native.prefill_pairs_here():
        return BF16_PAIRS_EXTEND
    if bits == 512:
        return MAX_NATIVE_EXTEND
    if bits == 256 and dtype == torch.float32 and code_dtype in (None, torch.float32, torch.int8):
        return AVX2_NATIVE_EXTEND
    return 1


def plan_native(
    table: torch.Tensor,
    rows: list[int],
    prefix_lens: list[int],
    extend_lens: list[int],
    starts: list[int] | None,
    max_shared: int | None = None,
) -> NativePlan:
    """Per request given (decodes and extends alike): table row, tokens already in KV, new
    tokens, first new token in the flat batch (None: all are decodes, in flat order);
    max_shared: ForwardBatch.max_shared_prefix."""
    num_tokens = sum(extend_lens)
    all_decodes = starts is None  # (a subset of a step's decodes has starts of its own)
    decodes = range(len(rows)) if all_decodes else [
        i for i, n in enumerate(extend_lens) if n == 1]
    groups = []
    if len(decodes) >= 2:
        found = find_shared_prefixes(
            table,
            rows if all_decodes else [rows[i] for i in decodes],
            prefix_lens if all_decodes else [prefix_lens[i] for i in decodes],
            NATIVE_GROUPING,
            max_shared,
        )
        groups = [([decodes[j] for j in g.members], g.length) for g in found]

    if groups:
        grouped = {i for members, _ in groups for i in members}
        order: list[int] = []
        group_start = [0]
        group_prefix: list[int] = []
        for members, length in groups:
            order += members
            group_start.append(len(order))
            group_prefix.append(length)
        for i in range(len(rows)):
            if i not in grouped:
                order.append(i)
                group_start.append(len(order))
                group_prefix.append(0)
        order_t = int64_tensor(order)
        start_t = int64_tensor(group_start)
        prefix_t = int64_tensor(group_prefix)
    else:  # the usual step: everyone alone, in batch order
        order_t, start_t, prefix_t, _ = _everyone_alone(len(rows))
    req_len = np.fromiter(prefix_lens, np.int64, len(prefix_lens))
    if all_decodes:
        req_len += 1
        # (decodes are in flat order: request i's token is at i, whatever `order` says)
        q_start, _, _, n_new_t = _everyone_alone(len(rows))
    else:
        assert starts is not None
        n_new = np.fromiter(extend_lens, np.int64, len(extend_lens))
        req_len += n_new
        n_new_t, q_start = torch.from_numpy(n_new), int64_tensor(starts)
    return NativePlan(num_tokens, int64_tensor(rows), torch.from_numpy(req_len), q_start,
                      n_new_t, order_t, start_t, prefix_t)


@lru_cache(maxsize=16)
def _everyone_alone(n: int) -> tuple[torch.Tensor, ...]:
    """The plan's tensors that depend only on the request count when nobody shares a prefix
    (0..n-1 as order, 0..n as group starts, zeros as group prefixes) and n ones (decodes' new
    tokens): made once per batch size, since a step's fresh small arrays cost ~10 us a call in
    the loop (the kernel only reads them)."""
    iota = torch.from_numpy(np.arange(n + 1, dtype=np.int64))
    return (iota[:-1], iota, torch.from_numpy(np.zeros(n, np.int64)),
            torch.from_numpy(np.ones(n, np.int64)))


def native_attention(
    q: torch.Tensor,
    layer: LayerKV,
    table: torch.Tensor,
    plan: NativePlan,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """q, out: [T, H, D] (the whole step; the plan's requests' rows of out are written)."""
    return attention_kernels.paged_attention(q, layer.k, layer.v, table, plan.req_row,
                                             plan.req_len, plan.q_start, plan.n_new, plan.order,
                                             plan.group_start, plan.group_prefix, scale, out,
                                             layer.k_scale, layer.v_scale)


@dataclass(slots=True)
class PrefillPlan:
    """The prefill kernel's per-step arguments for R extends (int64 [R])."""

    num_tokens: int  # new tokens of these requests
    req_row: torch.Tensor  # table rows
    req_len: torch.Tensor  # context lengths, new tokens included
    q_start: torch.Tensor  # first new token of each request in the flat batch
    n_new: torch.Tensor  # new tokens of each request


def plan_prefill(rows: list[int], prefix_lens: list[int], extend_lens: list[int],
                 starts: list[int]) -> PrefillPlan:
    """Per extend: table row, tokens already in KV, new tokens, first new token in the batch."""
    n_new = np.fromiter(extend_lens, np.int64, len(extend_lens))
    req_len = np.fromiter(prefix_lens, np.int64, len(prefix_lens)) + n_new
    return PrefillPlan(int(n_new.sum()), int64_tensor(rows), torch.from_numpy(req_len),
                       int64_tensor(starts), torch.from_numpy(n_new))


def prefill_attention(
    q: torch.Tensor,
    layer: LayerKV,
    table: torch.Tensor,
    plan: PrefillPlan,
    scale: float,
    out: torch.Tensor,
    tiles: int = 0,
) -> torch.Tensor:
    """q, out: [T, H, D] (the whole step; the plan's requests' rows of out are written); tiles:
    attention_kernels.prefill_attention's."""
    return attention_kernels.prefill_attention(q, layer.k, layer.v, table, plan.req_row,
                                               plan.req_len, plan.q_start, plan.n_new, scale, out,
                                               layer.k_scale, layer.v_scale, tiles)
