"""The attention backend interface.

A backend owns nothing but views of the KV pool and the request-to-token table. Once per step,
`plan` turns the step's `ForwardBatch` into metadata (index tensors, masks) that every layer
reuses; each attention layer then calls `forward`, which writes the layer's new K/V into the
pool at the batch's out slots and attends each new token over its request's context, read from
the pool through the table. The metadata carries the backend that planned it, so the model
needs no global context and no reference to the runner: it calls `meta.backend.forward(...)`.

Semantics of a step: request i has `prefix_lens[i]` tokens already in KV (table row positions
[0, prefix)) and `extend_lens[i]` new tokens at positions [prefix, prefix + extend). New token
j of request i attends to positions [0, prefix + j] (causal). A decode is an extend of one.
The runner writes the table (including the new tokens' slots) before `plan` is called.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from banyan.batch import ForwardBatch
from banyan.mem.kv_pool import KVPool
from banyan.mem.req_table import ReqToTokenTable


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step plan; backends subclass it with their own index tensors."""

    backend: AttentionBackend
    num_tokens: int  # T: new tokens in the step


class AttentionBackend(ABC):
    name = "abstract"  # set by the registry

    def __init__(self, pool: KVPool, table: ReqToTokenTable) -> None:
        self.pool = pool
        self.table = table

    @classmethod
    def supports(cls, pool: KVPool) -> bool:
        """Whether this backend runs over this pool (device, dtype, kernels available)."""
        return cls.refusal(pool) is None

    @classmethod
    def refusal(cls, pool: KVPool) -> str | None:
        """Why this backend cannot run over this pool, said to the user (None: it can, or it
        gives no reason; a backend overrides this or `supports`)."""
        return None

    # ---- CUDA-graph hooks: a backend that can be captured keeps its metadata in static
    # buffers sized for max_batch decodes, refilled in place before each replay.

    supports_graphs = False

    def init_graph_buffers(self, max_batch: int) -> None:
        raise NotImplementedError(f"{self.name} cannot be captured in a CUDA graph")

    def plan_for_capture(self, batch_size: int) -> AttentionMetadata:
        """Metadata over the static buffers for a decode batch of this size (capture)."""
        raise NotImplementedError(f"{self.name} cannot be captured in a CUDA graph")

    def plan_for_replay(self, batch: ForwardBatch, out_slots: torch.Tensor) -> AttentionMetadata:
        """Refill the static buffers for this decode batch (replay): its b rows, and the rows
        past b padded so that they write and read the padding slot 0 only."""
        raise NotImplementedError(f"{self.name} cannot be captured in a CUDA graph")

    @abstractmethod
    def plan(self, batch: ForwardBatch, out_slots: torch.Tensor) -> AttentionMetadata:
        """Build the step's metadata. out_slots: [T] int64 on the pool's device (the runner
        already made it, so the backend does not copy the list again)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q: [T, heads, head_dim], k/v: [T, kv_heads, head_dim] (RoPE applied) ->
        out: [T, heads, head_dim]. Stores k/v at the step's out slots of layer `layer_id`."""
