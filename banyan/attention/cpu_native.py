"""The "cpu-native" attention backend: decodes and prefill chunks of up to MAX_NATIVE_EXTEND
tokens through the C++ CPU kernel (native_plan.py; decodes only where it has no AVX-512 paths),
everything else (longer chunks) on the SDPA paths it inherits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from banyan.attention.base import AttentionMetadata
from banyan.attention.prefix_groups import CascadePolicy
from banyan.attention.native_plan import (
    NativePlan,
    default_max_extend,
    native_attention,
    plan_native,
)
from banyan.attention.registry import register_backend
from banyan.attention.torch_backend import SdpaBackend, TorchAttentionMetadata, token_starts
from banyan.batch import ForwardBatch
from banyan.kernels import native as native_kernels
from banyan.mem.kv_pool import KVPool
from banyan.mem.req_table import ReqToTokenTable


@dataclass(slots=True)
class NativeMetadata(TorchAttentionMetadata):
    native: NativePlan | None = None  # the kernel's requests; the inherited paths get the rest


@register_backend("cpu-native")
class CpuNativeBackend(SdpaBackend):
    def __init__(self, pool: KVPool, table: ReqToTokenTable, scale: float | None = None, *,
                 cascade: CascadePolicy | None = CascadePolicy(),
                 max_extend: int | None = None) -> None:
        super().__init__(pool, table, scale, cascade=cascade)
        # Extends of up to this many tokens go to the kernel (decodes always do).
        self.max_extend = default_max_extend() if max_extend is None else max_extend

    @classmethod
    def supports(cls, pool: KVPool) -> bool:
        return native_kernels.supports(pool.device, pool.dtype, pool.code_dtype)

    def plan(self, batch: ForwardBatch, out_slots: torch.Tensor) -> NativeMetadata:
        meta = NativeMetadata(backend=self, num_tokens=batch.num_tokens, out_slots=out_slots)
        if batch.num_tokens == batch.batch_size:  # decodes only: the kernel takes all
            meta.native = plan_native(self.table.table, batch.rows, batch.prefix_lens,
                                      batch.extend_lens, None)
            return meta
        starts = token_starts(batch)
        if max(batch.extend_lens) <= self.max_extend:  # the usual step: the kernel takes all
            meta.native = plan_native(self.table.table, batch.rows, batch.prefix_lens,
                                      batch.extend_lens, starts)
            return meta
        taken = [i for i, n in enumerate(batch.extend_lens) if n <= self.max_extend]
        if taken:
            meta.native = plan_native(
                self.table.table,
                [batch.rows[i] for i in taken],
                [batch.prefix_lens[i] for i in taken],
                [batch.extend_lens[i] for i in taken],
                [starts[i] for i in taken],
            )
        self._plan_paths(meta, batch, starts, set(taken))
        return meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                meta: AttentionMetadata) -> torch.Tensor:
        assert isinstance(meta, NativeMetadata)
        nat = meta.native
        if nat is None:
            return super().forward(q, k, v, layer_id, meta)
        T, H, D = q.shape
        # the kernel reads the pool; only the SDPA paths (longer chunks) read k, v
        k, v = self.pool.store(layer_id, meta.out_slots, k, v, seen=nat.num_tokens < T)
        q = q.contiguous()
        out = q.new_empty((T, H, D))
        native_attention(q, self.pool.layer(layer_id), self.table.table, nat, self.scale, out)
        if nat.num_tokens < T:  # longer chunks: the SDPA paths
            self._attend_paths(q, k, v, layer_id, meta, out)
        return out
