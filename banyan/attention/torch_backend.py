"""The portable attention backend ("sdpa") on `torch.nn.functional.scaled_dot_product_attention`
(CPU and CUDA).

Decodes (requests with one new token) run as ONE batched SDPA per layer: their contexts are
gathered from the pool into a padded [B, Lmax] block with a length mask. GQA is handled without
repeating K/V: the G query heads sharing a KV head are laid out as SDPA's "query length"
dimension ([B, kv_heads, G, D] against [B, kv_heads, Lmax, D]), which is exact for a single
query token and much faster on CPU than `enable_gqa` or `repeat_interleave`.

Extends (several new tokens) loop over requests: with no cached prefix they attend the fresh
K/V directly with `is_causal`; with a prefix they gather [0, prefix + n) from the pool and use an
offset causal mask (SDPA's `is_causal` is top-left aligned, wrong when the key length differs).

Decodes, and extends of up to `CascadePolicy.max_extend` tokens, whose rows share a cached prefix
(the same slots at the start of their table rows, e.g. a shared system prompt) take the cascade
path instead (cascade.py): the prefix is gathered once per group and layer and attended by all
the group's queries in one SDPA, their own parts as a padded batch, the two merged exactly by
log-sum-exp. Decodes and extends are planned as two separate cascades (their own parts pad to
different query counts). The paths above are the P = 0 case and still run whatever shares
nothing long enough (`prefix_groups.CascadePolicy`).

Gathers write into a workspace kept by the backend and grown on demand: on CPU a fresh
allocation of that size is mostly page faults (measured 5x slower than the copy itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from banyan.attention.base import AttentionBackend, AttentionMetadata
from banyan.attention.cascade import CascadePlan, cascade_attention, plan_cascade
from banyan.attention.prefix_groups import CascadePolicy, SharedPrefix, find_shared_prefixes
from banyan.attention.registry import register_backend
from banyan.batch import ForwardBatch
from banyan.mem.kv_pool import KVPool
from banyan.mem.req_table import ReqToTokenTable

_TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
_HAS_ENABLE_GQA = _TORCH_VERSION >= (2, 5)


@dataclass(slots=True)
class ExtendPlan:
    start: int  # first of the request's tokens in the flat batch
    length: int  # n new tokens
    prefix: int  # tokens already in KV
    kv_index: torch.Tensor | None  # [prefix + n] int64 slots; None when prefix == 0
    mask: torch.Tensor | None  # [n, prefix + n] bool (True = attend); None when prefix == 0


@dataclass(slots=True)
class TorchAttentionMetadata(AttentionMetadata):
    out_slots: torch.Tensor  # [T] int64
    # Decodes on the plain (single SDPA) path. Their tokens: a slice of the flat batch when they
    # are contiguous (the usual layout), else an index tensor; None when there is none.
    dec_tokens: slice | torch.Tensor | None = None
    dec_count: int = 0  # Bd (plain decodes only)
    dec_len: int = 0  # Lmax: longest decode context, new token included
    dec_kv_index: torch.Tensor | None = None  # [Bd * Lmax] int64, padded with slot 0
    dec_mask: torch.Tensor | None = None  # [Bd, 1, 1, Lmax] bool
    # Decodes, and extends, grouped by a shared cached prefix (cascade path); None when no
    # group qualifies.
    cascade: CascadePlan | None = None
    ext_cascade: CascadePlan | None = None
    extends: list[ExtendPlan] = field(default_factory=list)


@register_backend("sdpa")
class SdpaBackend(AttentionBackend):
    def __init__(
        self,
        pool: KVPool,
        table: ReqToTokenTable,
        scale: float | None = None,
        *,
        cascade: CascadePolicy | None = CascadePolicy(),
    ) -> None:
        """cascade: when requests sharing a cached prefix take the cascade path; None: never."""
        super().__init__(pool, table)
        self.scale = scale if scale is not None else pool.head_dim**-0.5
        self.cascade = cascade
        empty = torch.empty((0, pool.kv_heads, pool.head_dim), dtype=pool.dtype, device=pool.device)
        self._ws_k = empty
        self._ws_v = empty
        # float32 copies for the cascade path (the same tensors when the pool is float32)
        self._wf_k = self._ws_k
        self._wf_v = self._ws_v

    # ---------------------------------------------------------------- plan (once per step)

    def plan(self, batch: ForwardBatch, out_slots: torch.Tensor) -> TorchAttentionMetadata:
        meta = TorchAttentionMetadata(
            backend=self, num_tokens=batch.num_tokens, out_slots=out_slots
        )
        self._plan_paths(meta, batch, token_starts(batch), taken=set())
        return meta

    def _plan_paths(self, meta: TorchAttentionMetadata, batch: ForwardBatch, starts: list[int],
                    taken: set[int]) -> None:
        """Plan every request of the batch but those in `taken` (batch indices another
        path computes) on the plain decode, cascade and extend paths."""
        device = self.pool.device
        policy = self.cascade
        dec_reqs: list[int] = []  # batch indices of decodes
        ext_reqs: list[int] = []  # ... of extends over a cached prefix, cascade candidates
        for i, n in enumerate(batch.extend_lens):
            if i in taken:
                continue
            if n == 1:
                dec_reqs.append(i)
            elif policy is not None and batch.prefix_lens[i] and n <= policy.max_extend:
                ext_reqs.append(i)
        plain_dec = dec_reqs
        if policy is not None and len(dec_reqs) >= 2:
            meta.cascade, plain_dec = self._plan_cascade(policy, batch, dec_reqs, starts, 0)
        grouped_ext: set[int] = set()
        if policy is not None and len(ext_reqs) >= 2:
            ratio = policy.extend_prefix_ratio
            meta.ext_cascade, rest = self._plan_cascade(policy, batch, ext_reqs, starts, ratio)
            grouped_ext = set(ext_reqs) - set(rest)
        need = 0  # workspace rows this step needs
        for i, (prefix, n) in enumerate(zip(batch.prefix_lens, batch.extend_lens, strict=True)):
            if n == 1 or i in grouped_ext or i in taken:
                continue
            if prefix == 0:
                meta.extends.append(ExtendPlan(starts[i], n, 0, None, None))
                continue
            total = prefix + n
            kv_index = self.table.read(batch.rows[i], total).to(torch.int64)
            # Query j sits at position prefix + j and sees keys [0, prefix + j].
            mask = torch.ones((n, total), dtype=torch.bool, device=device).tril_(diagonal=prefix)
            meta.extends.append(ExtendPlan(starts[i], n, prefix, kv_index, mask))
            need = max(need, total)
        if plain_dec:
            need = max(need, self._plan_plain_decodes(meta, plain_dec, batch, starts))
        self._reserve(need)

    def _plan_cascade(
        self,
        policy: CascadePolicy,
        batch: ForwardBatch,
        reqs: list[int],
        starts: list[int],
        prefix_ratio: int,
    ) -> tuple[CascadePlan | None, list[int]]:
        """Cascade plan of those of `reqs` (batch indices, all decodes or all extends) that share
        a prefix worth it, with P >= prefix_ratio x their own part -> (plan or None, the rest of
        reqs for the plain path)."""
        rows = [batch.rows[i] for i in reqs]
        prefix_lens = [batch.prefix_lens[i] for i in reqs]
        extend_lens = [batch.extend_lens[i] for i in reqs]

        def own(j: int, p: int) -> int:  # own part of request j over a shared prefix p
            return prefix_lens[j] - p + extend_lens[j]

        groups: list[SharedPrefix] = []
        for g in find_shared_prefixes(self.table.table, rows, prefix_lens, policy,
                                      batch.max_shared_prefix):
            kept = [j for j in g.members if prefix_ratio * own(j, g.length) <= g.length]
            if len(kept) >= 2 and (len(kept) - 1) * g.length >= policy.min_saved:
                groups.append(SharedPrefix(kept, g.length))
        if not groups:
            return None, reqs
        # The own parts' padded block: rows x queries x own length (see CascadePolicy).
        members = [j for g in groups for j in g.members]
        longest_own = max(own(j, g.length) for g in groups for j in g.members)
        block = len(members) * max(extend_lens[j] for j in members) * longest_own
        if block > policy.max_own_block:
            return None, reqs
        plan = plan_cascade(
            self.table.table,
            self.pool.kv_heads,
            self.pool.head_dim,
            groups,
            rows,
            prefix_lens,
            extend_lens,
            [starts[i] for i in reqs],
        )
        # own parts and one group's prefix take turns in the workspace
        self._reserve_float(max(plan.num_rows * plan.own_len, max(g.length for g in plan.groups)))
        grouped = set(members)
        return plan, [i for j, i in enumerate(reqs) if j not in grouped]

    def _plan_plain_decodes(
        self, meta: TorchAttentionMetadata, which: list[int], batch: ForwardBatch, starts: list[int]
    ) -> int:
        """Padded-batch metadata of the decodes `which` (batch indices) -> workspace rows."""
        device = self.pool.device
        bd = len(which)
        seq_lens = [batch.prefix_lens[i] + 1 for i in which]
        lmax = max(seq_lens)
        rows = torch.tensor([batch.rows[i] for i in which], dtype=torch.int64).to(device)
        lens = torch.tensor(seq_lens, dtype=torch.int64).to(device)
        # Positions past a request's length read whatever the table holds (0 or stale
        # slots): finite values, masked out.
        meta.dec_kv_index = self.table.table[rows, :lmax].to(torch.int64).reshape(-1)
        meta.dec_mask = (torch.arange(lmax, device=device)[None, :] < lens[:, None]).view(
            bd, 1, 1, lmax
        )
        meta.dec_count, meta.dec_len = bd, lmax
        tokens = [starts[i] for i in which]
        first = tokens[0]
        if tokens[-1] - first == bd - 1:  # contiguous run of tokens
            meta.dec_tokens = slice(first, first + bd)
        else:
            meta.dec_tokens = torch.tensor(tokens, dtype=torch.int64).to(device)
        return bd * lmax

    def _reserve(self, rows: int) -> None:
        if rows > self._ws_k.shape[0]:
            # Grow by 25% at least, so slowly lengthening contexts do not reallocate every step.
            rows = max(rows, self._ws_k.shape[0] * 5 // 4)
            shape = (rows, self.pool.kv_heads, self.pool.head_dim)
            self._ws_k = torch.empty(shape, dtype=self.pool.dtype, device=self.pool.device)
            self._ws_v = torch.empty(shape, dtype=self.pool.dtype, device=self.pool.device)
            if self.pool.dtype == torch.float32:
                self._wf_k, self._wf_v = self._ws_k, self._ws_v

    def _reserve_float(self, rows: int) -> None:
        """The cascade's float32 workspaces (sized by the cascade alone: they double as the
        staging workspaces when the pool is float32)."""
        self._reserve(rows)
        if rows > self._wf_k.shape[0]:
            rows = max(rows, self._wf_k.shape[0] * 5 // 4)
            shape = (rows, self.pool.kv_heads, self.pool.head_dim)
            self._wf_k = torch.empty(shape, dtype=torch.float32, device=self.pool.device)
            self._wf_v = torch.empty(shape, dtype=torch.float32, device=self.pool.device)

    # ---------------------------------------------------------------- forward (every layer)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        assert isinstance(meta, TorchAttentionMetadata)
        # q: [T, H, D]; k, v: [T, KVH, D] (as the pool holds them: dequantized when quantized)
        k, v = self.pool.store(layer_id, meta.out_slots, k, v)
        T, H, D = q.shape
        if meta.dec_count == T:  # decode-only step: no scatter back
            return self._decode(q, layer_id, meta)
        out = q.new_empty((T, H, D))
        self._attend_paths(q, k, v, layer_id, meta, out)
        return out

    def _attend_paths(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                      meta: TorchAttentionMetadata, out: torch.Tensor) -> None:
        """Write the rows of `out` that `_plan_paths` planned."""
        if meta.dec_tokens is not None:
            if isinstance(meta.dec_tokens, slice):
                out[meta.dec_tokens] = self._decode(q[meta.dec_tokens], layer_id, meta)
            else:
                qd = q.index_select(0, meta.dec_tokens)
                out.index_copy_(0, meta.dec_tokens, self._decode(qd, layer_id, meta))
        for casc in (meta.cascade, meta.ext_cascade):
            if casc is not None:
                ws = (self._ws_k, self._ws_v, self._wf_k, self._wf_v)
                oc = cascade_attention(q, self.pool.layer(layer_id), casc, self.scale, ws)
                out.index_copy_(0, casc.tokens, oc)
        for ext in meta.extends:
            out[ext.start : ext.start + ext.length] = self._extend(q, k, v, layer_id, ext)

    def _gather(self, layer_id: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # index: [N] int64 slots -> k, v: [N, KVH, D] views of the workspace
        layer = self.pool.layer(layer_id)
        return layer.select(0, index, self._ws_k), layer.select(1, index, self._ws_v)

    def _decode(
        self, qd: torch.Tensor, layer_id: int, meta: TorchAttentionMetadata
    ) -> torch.Tensor:
        # qd: [B, H, D] -> [B, H, D], each row attending its own context of <= Lmax tokens
        assert meta.dec_kv_index is not None
        B, H, D = qd.shape
        kvh, lmax = self.pool.kv_heads, meta.dec_len
        k, v = self._gather(layer_id, meta.dec_kv_index)  # [B*Lmax, KVH, D]
        k = k.view(B, lmax, kvh, D).transpose(1, 2)  # [B, KVH, Lmax, D]
        v = v.view(B, lmax, kvh, D).transpose(1, 2)
        qg = qd.reshape(B, kvh, H // kvh, D)  # the G heads of a KV head as "query length"
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=meta.dec_mask, scale=self.scale)
        return o.reshape(B, H, D)

    def _extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, ext: ExtendPlan
    ) -> torch.Tensor:
        # -> [n, H, D] for the request's n new tokens
        s, n = ext.start, ext.length
        qi = q[s : s + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if ext.kv_index is None:
            ki, vi = k[s : s + n], v[s : s + n]  # fresh K/V: nothing cached to read back
        else:
            ki, vi = self._gather(layer_id, ext.kv_index)  # [prefix + n, KVH, D]
        ki = ki.transpose(0, 1).unsqueeze(0)  # [1, KVH, S, D]
        vi = vi.transpose(0, 1).unsqueeze(0)
        causal = ext.mask is None
        o = sdpa_gqa(qi, ki, vi, ext.mask, causal, self.scale)  # [1, H, n, D]
        return o[0].transpose(0, 1)


def token_starts(batch: ForwardBatch) -> list[int]:
    """[B] flat index of each request's first new token."""
    starts, start = [], 0
    for n in batch.extend_lens:
        starts.append(start)
        start += n
    return starts


def sdpa_gqa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    if group == 1:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale
        )
    if _HAS_ENABLE_GQA:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
        )
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
