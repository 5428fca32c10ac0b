"""The "triton" attention backend: the Triton kernels of banyan/kernels/triton_attention.py over
the paged pool, read in place through the request-to-token table (nothing gathered).

Decodes (one new token) take the split-K decode kernel, everything longer (prefill chunks,
speculative checks) the extend kernel; a mixed step launches both, each writing its own rows of
the output. `plan` packs every index the kernels need into one int32 tensor, copied to the
device once per step.

Runs on CUDA devices. On CPU only under Triton's interpreter (TRITON_INTERPRET=1 set before
the kernels are first imported), which is how the tests check it: far too slow to serve, so
`auto` never picks it there. Pools of float32, bfloat16 or float16, or quantized ones
(`--kv-cache-dtype int8|fp8_e4m3|fp8_e5m2`), whose codes the kernels read in place.

Not done yet (needs a GPU to measure): CUDA-graph capture (the hooks below keep the base's
refusals), pinned host buffers for the per-step copy, tuned block sizes and split counts.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from types import ModuleType

import torch

from banyan.attention.base import AttentionBackend, AttentionMetadata
from banyan.attention.registry import register_backend
from banyan.attention.torch_backend import token_starts
from banyan.batch import ForwardBatch
from banyan.host_tensors import copy_into, to_device
from banyan.mem.kv_pool import KVPool
from banyan.mem.req_table import ReqToTokenTable

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Off CUDA (the interpreter) there is no multiprocessor count to fill: plan the split counts a
# 132-SM GPU (H100) would get, so the tests exercise the GPU's choices.
NOMINAL_SMS = 132


def _kernels() -> ModuleType:
    """The kernel module, imported on first use: the registry imports this file on machines
    without triton, and importing it decorates the kernels (for the interpreter or not)."""
    return importlib.import_module("banyan.kernels.triton_attention")


@dataclass(frozen=True, slots=True)
class SplitPolicy:
    """How many pieces a decode step cuts each context into (one count per step)."""

    # A split of fewer keys costs more in the merge and the extra launch than it saves.
    min_keys: int = 256
    max_splits: int = 16
    # Programs (decodes x KV heads x splits) that keep the GPU busy; None: 2 per multiprocessor.
    target_programs: int | None = None


@dataclass(slots=True)
class DecodePlan:
    rows: torch.Tensor  # [B] int32 table rows
    seq_lens: torch.Tensor  # [B] int32: context length, the new token included
    tokens: torch.Tensor  # [B] int32: each decode's row in the flat batch
    splits: int
    # float32 scratch shared by every layer of the step, made by the first layer (the query
    # head count is only known there): partial outputs [B, H, S, D], log-sum-exps [B, H, S].
    # Bounded, not growing with context: B <= max_rows and S <= SplitPolicy.max_splits, and
    # split_count keeps B x kv_heads x S under target_programs + B x kv_heads, so at most
    # (target_programs + B x kv_heads) x group x D floats; one per step (or per captured graph
    # bucket), from the caching allocator, freed with the step's metadata.
    mid_o: torch.Tensor | None = None
    mid_lse: torch.Tensor | None = None


@dataclass(slots=True)
class ExtendPlan:
    rows: torch.Tensor  # [E] int32 per extending request
    prefix: torch.Tensor  # [E] tokens already in KV
    lens: torch.Tensor  # [E] new tokens
    tokens: torch.Tensor  # [E] first new token's row in the flat batch
    block_req: torch.Tensor  # [NB] int32 per BLOCK_M new tokens: its request (0..E-1) ...
    block_start: torch.Tensor  # [NB] ... and its first token within the request's new ones


@dataclass(slots=True)
class TritonMetadata(AttentionMetadata):
    out_slots: torch.Tensor  # [T] int64
    decode: DecodePlan | None = None
    extend: ExtendPlan | None = None


@register_backend("triton")
class TritonBackend(AttentionBackend):
    def __init__(self, pool: KVPool, table: ReqToTokenTable, scale: float | None = None, *,
                 splits: SplitPolicy = SplitPolicy()) -> None:
        reason = self.refusal(pool)
        if reason is not None:
            raise ValueError(f"attention_backend: 'triton' {reason}")
        super().__init__(pool, table)
        self.scale = scale if scale is not None else pool.head_dim**-0.5
        self.kernels = _kernels()
        self.split_policy = splits
        target = splits.target_programs
        if target is None:
            sms = (torch.cuda.get_device_properties(pool.device).multi_processor_count
                   if pool.device.type == "cuda" else NOMINAL_SMS)
            target = 2 * sms
        self.target_programs = target

    @classmethod
    def refusal(cls, pool: KVPool) -> str | None:
        if pool.dtype not in DTYPES:
            return f"does not compute in {pool.dtype}"
        if importlib.util.find_spec("triton") is None:
            return "needs the triton package (pip install triton)"
        if pool.device.type == "cuda":
            return None
        if pool.device.type == "cpu" and _kernels().INTERPRETED:
            return None
        return (f"runs on CUDA devices, not {pool.device} (on CPU only under Triton's "
                "interpreter, TRITON_INTERPRET=1, a test tool)")

    # ---------------------------------------------------------------- plan (once per step)

    def plan(self, batch: ForwardBatch, out_slots: torch.Tensor) -> TritonMetadata:
        starts = token_starts(batch)
        dec = [i for i, n in enumerate(batch.extend_lens) if n == 1]
        ext = [i for i, n in enumerate(batch.extend_lens) if n > 1]
        block_m = self.kernels.extend_blocks(self.pool.head_dim)[0]
        ints: list[int] = []  # every index, in the order the views below take them
        if dec:
            ints += [batch.rows[i] for i in dec]
            ints += [batch.prefix_lens[i] + 1 for i in dec]
            ints += [starts[i] for i in dec]
        blocks = [(j, m0) for j, i in enumerate(ext)
                  for m0 in range(0, batch.extend_lens[i], block_m)]
        if ext:
            ints += [batch.rows[i] for i in ext]
            ints += [batch.prefix_lens[i] for i in ext]
            ints += [batch.extend_lens[i] for i in ext]
            ints += [starts[i] for i in ext]
            ints += [j for j, _ in blocks] + [m0 for _, m0 in blocks]
        packed = to_device(torch.tensor(ints, dtype=torch.int32), self.pool.device)
        parts = iter(packed.split([len(dec)] * (3 if dec else 0)
                                  + [len(ext)] * (4 if ext else 0)
                                  + [len(blocks)] * (2 if ext else 0)))
        meta = TritonMetadata(backend=self, num_tokens=batch.num_tokens, out_slots=out_slots)
        if dec:
            longest = max(batch.prefix_lens[i] for i in dec) + 1
            splits = self.kernels.split_count(
                len(dec) * self.pool.kv_heads, longest, self.split_policy.min_keys,
                self.split_policy.max_splits, self.target_programs)
            meta.decode = DecodePlan(next(parts), next(parts), next(parts), splits)
        if ext:
            meta.extend = ExtendPlan(*(next(parts) for _ in range(6)))
        return meta

    # ---------------------------------------------------------------- CUDA graphs (decodes)
    # The decode plan's tensors become static buffers sized for the largest batch; a bucket's
    # split count is fixed at capture (it sets the kernel grid) for the longest context a row
    # can hold, so a replay's shorter contexts leave some splits empty, which the merge weighs 0.

    supports_graphs = True

    def init_graph_buffers(self, max_batch: int) -> None:
        dev = self.pool.device
        self._g_ints = torch.zeros(3, max_batch, dtype=torch.int32, device=dev)
        self._g_out_slots = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self._g_plans: dict[int, TritonMetadata] = {}

    def plan_for_capture(self, batch_size: int) -> AttentionMetadata:
        rows, seq_lens, tokens = (self._g_ints[i, :batch_size] for i in range(3))
        self._fill_graph_buffers([], [], torch.zeros(0, dtype=torch.int64), batch_size)
        splits = self.kernels.split_count(
            batch_size * self.pool.kv_heads, self.table.max_context,
            self.split_policy.min_keys, self.split_policy.max_splits, self.target_programs)
        meta = TritonMetadata(backend=self, num_tokens=batch_size,
                              out_slots=self._g_out_slots[:batch_size],
                              decode=DecodePlan(rows, seq_lens, tokens, splits))
        self._g_plans[batch_size] = meta
        return meta

    def plan_for_replay(self, batch: ForwardBatch, out_slots: torch.Tensor) -> AttentionMetadata:
        self._fill_graph_buffers(batch.rows, [p + 1 for p in batch.prefix_lens], out_slots,
                                 self._g_ints.shape[1])
        return TritonMetadata(backend=self, num_tokens=batch.batch_size,
                              out_slots=self._g_out_slots[:batch.batch_size])

    def _fill_graph_buffers(self, rows: list[int], seq_lens: list[int],
                            out_slots: torch.Tensor, size: int) -> None:
        """Rows [0, b) from the batch; rows b.. padded: table row 0, one key, writing and
        reading the padding slot 0 (their outputs are never read)."""
        b = len(rows)
        host = torch.zeros(3, size, dtype=torch.int32)
        host[0, :b] = torch.tensor(rows, dtype=torch.int32)
        host[1, :] = 1
        host[1, :b] = torch.tensor(seq_lens, dtype=torch.int32)
        host[2, :] = torch.arange(size, dtype=torch.int32)
        copy_into(self._g_ints[:, :size], host)  # (no second copy on the device)
        self._g_out_slots[b:size].zero_()
        self._g_out_slots[:b].copy_(out_slots)

    # ---------------------------------------------------------------- forward (every layer)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                meta: AttentionMetadata) -> torch.Tensor:
        assert isinstance(meta, TritonMetadata)
        # the kernels read every key from the pool, the new tokens' too
        self.pool.store(layer_id, meta.out_slots, k, v, seen=False)
        if q.stride(-1) != 1:  # the kernels step over head_dim with stride 1
            q = q.contiguous()
        out = q.new_empty(q.shape)
        layer = self.pool.layer(layer_id)
        table = self.table.table
        dec = meta.decode
        if dec is not None:
            if dec.mid_o is None or dec.mid_lse is None:
                shape = (dec.rows.shape[0], q.shape[1], dec.splits)
                dec.mid_lse = torch.empty(shape, dtype=torch.float32, device=q.device)
                dec.mid_o = torch.empty((*shape, q.shape[2]), dtype=torch.float32,
                                        device=q.device)
            self.kernels.decode_attention(q, layer.k, layer.v, table, dec.rows, dec.seq_lens,
                                          dec.tokens, dec.mid_o, dec.mid_lse, self.scale, out,
                                          layer.k_scale, layer.v_scale)
        ext = meta.extend
        if ext is not None:
            self.kernels.extend_attention(q, layer.k, layer.v, table, ext.rows,
                                          ext.prefix, ext.lens, ext.tokens, ext.block_req,
                                          ext.block_start, self.scale, out, layer.k_scale,
                                          layer.v_scale)
        return out
