"""KV pool sizing, the slot allocator's order, the request-to-token table's writes, and the
pool's pages faulted in ahead of use."""

from __future__ import annotations

import pytest
import torch

from banyan.batch import ForwardBatch, RowPrefix
from banyan.mem.allocator import SlotAllocator
from banyan.mem.kv_pool import KVPool, kv_bytes_per_slot, lazy_zeros, num_slots_for_bytes
from banyan.mem import prefault
from banyan.mem.prefault import PoolPrefaulter
from banyan.mem.req_table import ReqToTokenTable


def test_bytes_per_slot_and_budget() -> None:
    assert (
        kv_bytes_per_slot(layers=2, kv_heads=4, head_dim=8, dtype=torch.bfloat16)
        == 2 * 2 * 4 * 8 * 2
    )
    per = kv_bytes_per_slot(3, 2, 16, torch.float32)
    assert num_slots_for_bytes(per * 10 + per - 1, 3, 2, 16, torch.float32) == 10
    with pytest.raises(ValueError, match="at least 2"):
        num_slots_for_bytes(per, 3, 2, 16, torch.float32)


def test_pool_shapes_zeroed_and_store() -> None:
    pool = KVPool(layers=2, num_slots=6, kv_heads=2, head_dim=4, dtype=torch.float16, device="cpu")
    assert pool.k[1].shape == (6, 2, 4) and pool.v[0].dtype == torch.float16
    assert pool.total_bytes == 6 * 2 * 2 * 2 * 4 * 2
    assert not pool.k[0].any()  # slot 0 and unused slots are finite (zero)
    k = torch.ones(2, 2, 4, dtype=torch.float16)
    pool.store(1, torch.tensor([3, 5]), k, 2 * k)
    assert pool.k[1][[3, 5]].eq(1).all() and pool.v[1][[3, 5]].eq(2).all()
    assert not pool.k[1][[0, 1, 2, 4]].any() and not pool.k[0].any()
    with pytest.raises(ValueError):
        KVPool(1, 1, 1, 4, torch.float32, "cpu")


def test_table_write_batch_with_prefixes() -> None:
    table = ReqToTokenTable(max_rows=4, max_context=10, device="cpu")
    batch = ForwardBatch(
        rows=[2, 0],
        prefix_lens=[3, 0],
        extend_lens=[2, 3],
        input_ids=[1] * 5,
        out_slots=[20, 21, 30, 31, 32],
        row_prefixes=[RowPrefix(2, [7, 8, 9]), RowPrefix(3, [])],
    )
    token_rows = torch.tensor([2, 2, 0, 0, 0])
    positions = torch.tensor([3, 4, 0, 1, 2])
    table.write_batch(batch, token_rows, positions, torch.tensor(batch.out_slots))
    assert table.read(2, 6).tolist() == [7, 8, 9, 20, 21, 0]
    assert table.read(0, 4).tolist() == [30, 31, 32, 0]
    assert not table.table[[1, 3]].any()
    assert table.table.dtype == torch.int32


def test_allocator_hands_out_lowest_free_slots_in_runs() -> None:
    alloc = SlotAllocator(41)
    assert alloc.alloc(5) == [1, 2, 3, 4, 5]
    rest = alloc.alloc(35)
    assert rest == list(range(6, 41)) and alloc.alloc(1) is None
    # free a scattered mix, in no particular order, as finished requests do
    alloc.free([30, 7, 12, 8, 31, 9, 29, 11, 10])
    alloc.free([2, 3])
    assert alloc.num_free == 11
    assert alloc.alloc(3) == [2, 3, 7]  # lowest first, ascending
    assert alloc.alloc(5) == [8, 9, 10, 11, 12]  # a contiguous run, whatever the free order
    assert alloc.alloc(4) is None and alloc.num_free == 3  # nothing taken on failure
    assert alloc.alloc(3) == [29, 30, 31]
    big = list(range(1, 41))
    alloc.free(reversed(big))  # a large free is heapified at once
    assert alloc.free_set() == set(big) and alloc.alloc(40) == big


def test_lazy_zeros_reads_zero_and_keeps_writes() -> None:
    # a private anonymous mapping (huge pages advised): zero until written, each write its own
    pool = lazy_zeros((3, 5000, 64), torch.bfloat16, torch.device("cpu"))
    assert pool.shape == (3, 5000, 64) and not bool(pool.any())
    pool[1, 4999] = 2.0
    pool[2, 0, 5] = -1.0
    assert float(pool.sum()) == 127.0 and float(pool[1].sum()) == 128.0


def _rss_bytes() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Rss:"))


def test_the_prefaulter_takes_the_pages_and_changes_no_value() -> None:
    pool = KVPool(layers=2, num_slots=20_000, kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                  device="cpu")  # 4 regions of 5 MiB
    pool.k[1][7] = 3.0
    pool.v[0][19_999] = -2.0
    faulter = PoolPrefaulter(pool.regions(), pool.num_slots)
    if faulter.done:
        pytest.skip("no madvise(MADV_POPULATE_WRITE) here (Linux before 5.14)")
    before = _rss_bytes()
    chunks = 1
    while faulter.step(max_bytes=4 << 20):  # 20 MiB in 4 MiB turns, lowest slots first
        chunks += 1
        assert 0 < faulter.populated_slots < pool.num_slots
    assert faulter.done and faulter.populated_slots == pool.num_slots and chunks == 5
    # resident now (the two pages written above, huge pages perhaps, were already)
    assert _rss_bytes() - before > 0.7 * pool.total_bytes
    assert float(pool.k[1].float().sum()) == 3.0 * 128 and float(pool.v[0].float().sum()) == -256
    assert not pool.k[0].any() and not faulter.step()


def test_the_prefaulter_stops_while_the_host_still_has_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # a pool sized past the RAM left keeps faulting in as it fills, never all at once
    pool = KVPool(layers=1, num_slots=5000, kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                  device="cpu")
    faulter = PoolPrefaulter(pool.regions(), pool.num_slots)
    free = [prefault.KEEP_AVAILABLE + (64 << 20)]
    monkeypatch.setattr(prefault, "available_memory", lambda device: free[0])
    assert faulter.done or faulter.step(max_bytes=1 << 20)  # (done: no madvise here)
    free[0] = prefault.KEEP_AVAILABLE + (1 << 19)
    assert not faulter.step(max_bytes=1 << 20) and faulter.done
    assert faulter.populated_slots < pool.num_slots
