"""Decode steps replayed from CUDA graphs (nano-vllm's `capture_cudagraph`, over Banyan's
attention-backend hooks).

A decode step of a small model on a GPU is mostly kernel launches: ~10 per layer, each a few
microseconds of host time, for kernels that run for less. A CUDA graph records the launches of
one step once and replays them with a single call. What a graph reads must live at fixed
addresses, so the step's inputs (token ids, positions, out slots) and the backend's metadata
(`init_graph_buffers` / `plan_for_capture` / `plan_for_replay` in attention/base.py) are static
buffers sized for the largest batch, refilled in place before each replay. One graph per
batch-size bucket (1, 2, 4, 8, then every 16 up to the largest); a step of b decodes replays
the smallest bucket >= b with its rows past b padded (token 0 at position 0; the backend pads
its own buffers so those rows write and read the padding slot 0 only, which no request reads),
and reads back its first b rows. The buckets are captured
largest first and share one memory pool, so the smaller ones reuse the largest one's memory.

The graph calls go through `GraphApi`, so the capture and replay logic is tested on CPU with a
fake device that re-runs the recorded function at replay (tests/test_cuda_graph.py; with the
Triton backend under its interpreter, tests/test_triton_attention.py). The runner captures at
start-up on CUDA when the backend supports it (ModelRunner.enable_graphs) and replays from
`compute`, on the thread that runs the steps in order: a step prepared ahead (overlap) never
touches the static buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from banyan.attention.base import AttentionBackend, AttentionMetadata
from banyan.batch import ForwardBatch

# The model's forward: (input_ids [b], positions [b], metadata) -> hidden states [b, hidden].
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def batch_buckets(max_batch: int) -> list[int]:
    """The captured batch sizes: 1, 2, 4, 8, then every 16, and max_batch itself."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


class GraphApi(Protocol):
    """What the runner needs of CUDA graphs (torch.cuda's, or a test's fake)."""

    def new_graph(self) -> Any: ...
    def capture(self, graph: Any, pool: Any, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Record `run` into `graph` (memory from `pool`; None: a new pool) -> its output."""
        ...
    def replay(self, graph: Any) -> None: ...
    def pool_of(self, graph: Any) -> Any: ...
    def synchronize(self) -> None: ...


class TorchCudaGraphs:
    """torch.cuda's graphs: capture on a side stream (torch.cuda.graph does), shared pool."""

    def new_graph(self) -> Any:
        return torch.cuda.CUDAGraph()

    def capture(self, graph: Any, pool: Any, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        with torch.cuda.graph(graph, pool=pool):
            return run()

    def replay(self, graph: Any) -> None:
        graph.replay()

    def pool_of(self, graph: Any) -> Any:
        return graph.pool()

    def synchronize(self) -> None:
        torch.cuda.synchronize()


@dataclass(slots=True)
class _Captured:
    graph: Any
    hidden: torch.Tensor  # the graph's output: hidden states of every row of the bucket


class DecodeGraphs:
    """Captures the model's decode forward per bucket; `run(batch, ...)` replays one, or
    returns None for a step it does not cover (an extend, too many rows, a backend that
    cannot be captured): the caller then runs the model eagerly."""

    def __init__(self, forward: Forward, backend: AttentionBackend, max_batch: int,
                 device: torch.device, api: GraphApi | None = None) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.forward, self.backend, self.max_batch = forward, backend, max_batch
        self.api: GraphApi = api if api is not None else TorchCudaGraphs()
        self.buckets = batch_buckets(max_batch)
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self._graphs: dict[int, _Captured] = {}

    @property
    def captured(self) -> list[int]:
        return sorted(self._graphs)

    def capture(self) -> None:
        """Record every bucket, largest first (the others fit in its memory pool). Each is run
        once eagerly first: lazy initialisation (kernel autotuning, workspaces) must not
        happen inside a capture."""
        if not self.backend.supports_graphs:
            return
        self.backend.init_graph_buffers(self.max_batch)
        pool = None
        for size in reversed(self.buckets):
            meta = self.backend.plan_for_capture(size)
            run = self._runner(size, meta)
            run()  # warm-up, outside the graph
            self.api.synchronize()
            graph = self.api.new_graph()
            hidden = self.api.capture(graph, pool, run)
            if pool is None:
                pool = self.api.pool_of(graph)
            self._graphs[size] = _Captured(graph, hidden)
        self.api.synchronize()

    def _runner(self, size: int, meta: AttentionMetadata) -> Callable[[], torch.Tensor]:
        ids, pos = self.input_ids[:size], self.positions[:size]
        return lambda: self.forward(ids, pos, meta)

    def bucket_for(self, batch_size: int) -> int | None:
        for size in self.buckets:
            if size >= batch_size and size in self._graphs:
                return size
        return None

    def run(self, batch: ForwardBatch, input_ids: torch.Tensor, positions: torch.Tensor,
            out_slots: torch.Tensor) -> torch.Tensor | None:
        """Hidden states [b, hidden] of this decode step from a replay, or None (run eagerly).
        The table is already written (the runner does that for both paths)."""
        b = batch.batch_size
        if not batch.is_decode_only or batch.proposed and any(batch.proposed):
            return None
        size = self.bucket_for(b)
        if size is None:
            return None
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        if size > b:
            self.input_ids[b:size].zero_()
            self.positions[b:size].zero_()
        self.backend.plan_for_replay(batch, out_slots)
        captured = self._graphs[size]
        self.api.replay(captured.graph)
        return captured.hidden[:b]
