"""The "cpu-native" attention backend: every CPU step through the C++ kernels (SDPA: see below).

Decodes and prefill chunks of up to `max_extend` tokens go to the row kernel
(cpu_paged_attention.cpp; see native_plan.py), longer chunks to the blocked prefill kernel
(cpu_prefill_attention.cpp). The SDPA paths this backend inherits take those chunks only where
the prefill kernel is switched off: `prefill_kernel=False`, BANYAN_NATIVE_PREFILL=0 for a whole
process (the A/B switch of benchmarks/prefill_roofline.py); and by default, on a CPU with AMX
where SDPA (on AMX tiles) measured faster at start-up (prefill_choice.py), the fresh ones (no
cached prefix: the case the probe times). There the prefill kernel runs its products on AMX
tiles (cpu_prefill_tiles.h) once a start-up check finds their output the vector path's. The
registry picks the "sdpa" backend itself where the kernels cannot load or the dtype is
unsupported.

On Zen 3 (SmolLM2's 9 x 3 heads of 64, 2 threads; benchmarks/prefill_attention.py) the prefill
kernel took a fresh 2,048-token prefill in 38-48 ms against SDPA's 47-60 (float32; 100-126
GFLOP/s), 512 tokens in 3.2 ms against 6 (docs/performance.md).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

from banyan.attention.base import AttentionMetadata
from banyan.attention.decode_tiles import decode_tiles_route
from banyan.attention.prefill_choice import prefill_route
from banyan.attention.prefix_groups import CascadePolicy
from banyan.attention.native_plan import (
    NativePlan,
    PrefillPlan,
    default_max_extend,
    native_attention,
    plan_native,
    plan_prefill,
    prefill_attention,
)
from banyan.attention.registry import register_backend
from banyan.attention.torch_backend import SdpaBackend, TorchAttentionMetadata, token_starts
from banyan.batch import ForwardBatch
from banyan.kernels import native as native_kernels
from banyan.mem.kv_pool import KVPool
from banyan.mem.req_table import ReqToTokenTable

# "0" / "1": chunks past max_extend on SDPA / on the kernel, whatever the CPU
PREFILL_SWITCH = "BANYAN_NATIVE_PREFILL"


@dataclass(slots=True)
class NativeMetadata(TorchAttentionMetadata):
    native: NativePlan | None = None  # the row kernel's requests
    prefill: PrefillPlan | None = None  # the prefill kernel's; the inherited paths get the rest


@register_backend("cpu-native")
class CpuNativeBackend(SdpaBackend):
    def __init__(self, pool: KVPool, table: ReqToTokenTable, scale: float | None = None, *,
                 cascade: CascadePolicy | None = CascadePolicy(),
                 max_extend: int | None = None, prefill_kernel: bool | None = None,
                 tiles: int | None = None) -> None:
        super().__init__(pool, table, scale, cascade=cascade)
        # Extends of up to this many tokens go to the row kernel (decodes always do).
        if max_extend is None:
            max_extend = default_max_extend(pool.dtype, pool.code_dtype)
        self.max_extend = max_extend
        # Longer ones to the prefill kernel, else to the SDPA paths: all of them where it is
        # switched off; only fresh ones (no cached prefix: what the AMX probe timed) where
        # fresh_on_sdpa.
        # Its products on AMX tiles (2), emulated ones (1: tests), or its vector paths (0):
        # `tiles` where given (bf16 only), else as the start-up route decides.
        self.fresh_on_sdpa = False
        self.tiles = 0
        if prefill_kernel is None:
            switch = os.environ.get(PREFILL_SWITCH)
            prefill_kernel = switch != "0"
            if switch is None:
                route = prefill_route(pool.kv_heads, pool.head_dim, pool.dtype, pool.code_dtype)
                self.tiles, self.fresh_on_sdpa = route.tiles, route.fresh_on_sdpa
        # the row kernel's products, for the whole process: on AMX tiles where they check out
        # and measure faster (decode_tiles.py), else its vector loops
        decode_tiles_route(pool.kv_heads, pool.head_dim, pool.dtype, pool.code_dtype)
        if tiles is not None:
            assert pool.dtype == torch.bfloat16 or not tiles, "tiles take bf16 queries"
            self.tiles = tiles
        self.prefill_kernel = prefill_kernel

    def take_every_extend(self) -> None:
        """Every extend to the row kernel, whatever its length (runner/batch_invariant.py): a
        token's attention then has the bits it gets decoded, checked or in any chunk."""
        self.max_extend = sys.maxsize
        self.fresh_on_sdpa = False

    @classmethod
    def supports(cls, pool: KVPool) -> bool:
        return native_kernels.supports(pool.device, pool.dtype, pool.code_dtype)

    def plan(self, batch: ForwardBatch, out_slots: torch.Tensor) -> NativeMetadata:
        meta = NativeMetadata(backend=self, num_tokens=batch.num_tokens, out_slots=out_slots)
        if batch.num_tokens == batch.batch_size:  # decodes only: the row kernel takes all
            meta.native = plan_native(self.table.table, batch.rows, batch.prefix_lens,
                                      batch.extend_lens, None, batch.max_shared_prefix)
            return meta
        starts = token_starts(batch)
        if max(batch.extend_lens) <= self.max_extend:  # the usual step: the row kernel takes all
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
        if not self.prefill_kernel:
            self._plan_paths(meta, batch, starts, set(taken))
            return meta
        long = [i for i, n in enumerate(batch.extend_lens) if n > self.max_extend]
        if self.fresh_on_sdpa:
            fresh = {i for i in long if batch.prefix_lens[i] == 0}
            if fresh:
                self._plan_paths(meta, batch, starts, set(range(batch.batch_size)) - fresh)
                long = [i for i in long if i not in fresh]
                if not long:
                    return meta
        meta.prefill = plan_prefill(
            [batch.rows[i] for i in long],
            [batch.prefix_lens[i] for i in long],
            [batch.extend_lens[i] for i in long],
            [starts[i] for i in long],
        )
        return meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                meta: AttentionMetadata) -> torch.Tensor:
        assert isinstance(meta, NativeMetadata)
        nat, pre = meta.native, meta.prefill
        if nat is None and pre is None:  # (the prefill kernel off: all on SDPA)
            return super().forward(q, k, v, layer_id, meta)
        T, H, D = q.shape
        # the kernels read the pool; only the SDPA paths (prefill kernel off) read k, v
        covered = (nat.num_tokens if nat is not None else 0) + (
            pre.num_tokens if pre is not None else 0)
        k, v = self.pool.store(layer_id, meta.out_slots, k, v, seen=covered < T)
        q = q.contiguous()
        out = q.new_empty((T, H, D))
        layer = self.pool.layer(layer_id)
        if nat is not None:
            native_attention(q, layer, self.table.table, nat, self.scale, out)
        if pre is not None:
            prefill_attention(q, layer, self.table.table, pre, self.scale, out, self.tiles)
        if covered < T:
            self._attend_paths(q, k, v, layer_id, meta, out)
        return out
