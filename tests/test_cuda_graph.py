"""CUDA-graph capture and replay of decode steps, checked on CPU with a fake device: a fake
GraphApi records the function run inside each capture and re-runs it at replay into the same
output tensor, as a real graph re-launches its kernels over the same buffers. So what is tested
is Banyan's part: buckets, static buffers refilled in place, padding, the output rows read
back, and which steps fall back to the eager forward."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from banyan.attention.base import AttentionBackend, AttentionMetadata
from banyan.batch import ForwardBatch
from banyan.runner.cuda_graph import DecodeGraphs, batch_buckets

HIDDEN = 4


class FakeGraphs:
    """Capture: remembers the function and the output it produced. Replay: runs it again and
    writes the result into that same output tensor."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []
        self._recorded: dict[int, tuple[Callable[[], torch.Tensor], torch.Tensor]] = {}
        self._pool = object()

    def new_graph(self) -> Any:
        return object()  # a distinct handle

    def capture(self, graph: Any, pool: Any, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.events.append(("capture", pool))
        out = run()
        self._recorded[graph] = (run, out)
        return out

    def pool_of(self, graph: Any) -> Any:
        return self._pool

    def replay(self, graph: Any) -> None:
        run, out = self._recorded[graph]
        out.copy_(run())
        self.events.append(("replay", graph))

    def synchronize(self) -> None:
        pass

    def replayed_rows(self) -> int:
        """The batch size of the graph replayed last."""
        kind, graph = self.events[-1]
        assert kind == "replay"
        return self._recorded[graph][1].shape[0]


class StaticMeta(AttentionMetadata):
    def __init__(self, backend: AttentionBackend, num_tokens: int, lens: torch.Tensor,
                 slots: torch.Tensor) -> None:
        super().__init__(backend, num_tokens)
        self.lens, self.slots = lens, slots


class FakeBackend(AttentionBackend):
    """Keeps each row's context length and out slot in static buffers, as a graph-safe
    attention backend must."""

    supports_graphs = True

    def __init__(self) -> None:  # no pool or table: the fake model reads the metadata only
        self.lens = torch.zeros(0, dtype=torch.int64)
        self.slots = torch.zeros(0, dtype=torch.int64)

    def init_graph_buffers(self, max_batch: int) -> None:
        self.lens = torch.ones(max_batch, dtype=torch.int64)
        self.slots = torch.zeros(max_batch, dtype=torch.int64)

    def plan_for_capture(self, batch_size: int) -> AttentionMetadata:
        return StaticMeta(self, batch_size, self.lens[:batch_size], self.slots[:batch_size])

    def plan_for_replay(self, batch: ForwardBatch, out_slots: torch.Tensor) -> AttentionMetadata:
        b = batch.batch_size
        self.lens[:b] = torch.tensor(batch.prefix_lens) + 1
        self.lens[b:] = 1
        self.slots[:b] = out_slots
        self.slots[b:] = 0
        return StaticMeta(self, b, self.lens[:b], self.slots[:b])

    def plan(self, batch: ForwardBatch, out_slots: torch.Tensor) -> AttentionMetadata:
        lens = torch.tensor(batch.prefix_lens) + 1
        return StaticMeta(self, batch.batch_size, lens, out_slots)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                meta: AttentionMetadata) -> torch.Tensor:
        raise AssertionError("the fake model does not call attention")


def fake_model() -> Callable[..., torch.Tensor]:
    table = torch.randn(100, HIDDEN, generator=torch.Generator().manual_seed(0))

    def forward(ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        assert isinstance(meta, StaticMeta)
        return table[ids] * (pos + 1).unsqueeze(1) + (meta.lens * 1000
                                                      + meta.slots).unsqueeze(1)

    return forward


def decode(prefix_lens: list[int], seed: int) -> tuple[ForwardBatch, torch.Tensor,
                                                      torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b = len(prefix_lens)
    ids = torch.randint(1, 100, (b,), generator=g)
    slots = torch.randint(1, 500, (b,), generator=g)
    batch = ForwardBatch(rows=list(range(b)), prefix_lens=prefix_lens, extend_lens=[1] * b,
                         input_ids=ids.tolist(), out_slots=slots.tolist())
    return batch, ids, torch.tensor(prefix_lens), slots


def test_buckets() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(16) == [1, 2, 4, 8, 16]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]


def test_every_bucket_is_captured_largest_first_in_one_pool() -> None:
    api = FakeGraphs()
    graphs = DecodeGraphs(fake_model(), FakeBackend(), 20, torch.device("cpu"), api)
    graphs.capture()
    assert graphs.captured == [1, 2, 4, 8, 16, 20]
    pools = [pool for kind, pool in api.events if kind == "capture"]
    assert pools[0] is None and all(p is pools[1] for p in pools[1:]) and len(pools) == 6


@pytest.mark.parametrize("b", [1, 3, 8, 9, 17, 20])
def test_a_replay_gives_the_eager_forward_of_its_rows(b: int) -> None:
    api = FakeGraphs()
    backend = FakeBackend()
    model = fake_model()
    graphs = DecodeGraphs(model, backend, 20, torch.device("cpu"), api)
    graphs.capture()
    for seed in range(3):  # replays refill the same buffers: each sees only its own inputs
        batch, ids, pos, slots = decode([5 * i + seed for i in range(b)], seed)
        got = graphs.run(batch, ids, pos, slots)
        assert got is not None
        want = model(ids, pos, backend.plan(batch, slots))
        assert torch.equal(got, want)
    size = min(x for x in batch_buckets(20) if x >= b)  # the smallest bucket that holds b
    assert api.replayed_rows() == size
    assert graphs.input_ids[b:size].eq(0).all() and backend.slots[b:size].eq(0).all()


def test_steps_a_graph_does_not_cover_run_eagerly() -> None:
    api = FakeGraphs()
    graphs = DecodeGraphs(fake_model(), FakeBackend(), 8, torch.device("cpu"), api)
    graphs.capture()
    batch, ids, pos, slots = decode([3] * 9, 0)
    assert graphs.run(batch, ids, pos, slots) is None  # more rows than the largest bucket
    extend = ForwardBatch(rows=[0], prefix_lens=[0], extend_lens=[2], input_ids=[1, 2],
                          out_slots=[3, 4])
    assert graphs.run(extend, torch.tensor([1, 2]), torch.tensor([0, 1]),
                      torch.tensor([3, 4])) is None


def test_a_backend_without_graph_buffers_captures_nothing() -> None:
    class Eager(FakeBackend):
        supports_graphs = False

    api = FakeGraphs()
    graphs = DecodeGraphs(fake_model(), Eager(), 8, torch.device("cpu"), api)
    graphs.capture()
    assert graphs.captured == [] and api.events == []
    batch, ids, pos, slots = decode([1, 2], 0)
    assert graphs.run(batch, ids, pos, slots) is None
