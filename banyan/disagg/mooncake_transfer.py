"""The `mooncake` KV transfer backend: Mooncake's transfer engine writes K/V from the prefill
worker's pool straight into the decode worker's reserved slots (both pools registered with it;
TCP transport, peers found by P2P handshake, no etcd). No copy on either side: the ZMQ socket
carries only the fetch and the reply, not the bytes.

Slots of one request usually form a few ascending runs on both sides (the allocator hands out
lowest-first), so one transfer is layers x 2 x runs contiguous writes, submitted as one batch.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from banyan.mem.kv_pool import KVPool

INSTALL_HINT = ("the mooncake transfer backend needs `pip install "
                "mooncake-transfer-engine-non-cuda` and Debian's libibverbs1, even for TCP")


def slot_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of the runs where both slot lists ascend by one."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


class MooncakeTransfer:
    def __init__(self, host: str, pool: KVPool) -> None:
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise RuntimeError(f"{INSTALL_HINT} ({exc})") from exc
        self.engine: Any = TransferEngine()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise RuntimeError(f"Mooncake transfer engine did not start on {host} (rc {rc})")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        regions = pool.regions()
        for t in regions:
            if self.engine.register_memory(t.data_ptr(), t.nbytes) != 0:
                raise RuntimeError("Mooncake could not register the KV pool's memory")
        self.region_ptrs = [t.data_ptr() for t in regions]
        self.region_rows = [t.stride(0) * t.element_size() for t in regions]  # bytes per slot

    def write(self, session: str, src_slots: Sequence[int], dst_regions: Sequence[int],
              dst_slots: Sequence[int]) -> bool:
        """Copy the K/V of src_slots (this pool) into dst_slots of the pool at `session`
        (whose regions, as `KVPool.regions` lists them, start at dst_regions); True when all
        arrived."""
        if len(dst_regions) != len(self.region_ptrs):
            return False
        srcs: list[int] = []
        dsts: list[int] = []
        lengths: list[int] = []
        runs = slot_runs(src_slots, dst_slots)
        for src_base, dst_base, row in zip(self.region_ptrs, dst_regions, self.region_rows):
            for s, d, n in runs:
                srcs.append(src_base + s * row)
                dsts.append(dst_base + d * row)
                lengths.append(n * row)
        return self.engine.batch_transfer_sync_write(session, srcs, dsts, lengths) == 0
