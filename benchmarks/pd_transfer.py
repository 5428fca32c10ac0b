"""K/V transfer throughput of the P/D backends (zmq, mooncake) against a plain TCP socket copy of
the same bytes between the same two processes, measured side by side in one run: on loopback,
and across two network namespaces joined by veth pairs (real interfaces; needs root).

The source process holds a KV pool shaped like SmolLM2-135M's (30 layers, 3 KV heads of 64,
float32: 46,080 bytes per token) with --tokens tokens of seeded random K/V in its prefix cache,
served by banyan's KVSource; the sink process fetches them with banyan's KVSink (slots reserved,
K/V copied or written into its pool, inserted into its prefix cache) and checks every byte
against the same seed. The plain copy: the sink asks for as many bytes over one TCP connection
and reads them into a buffer (recv_into, no processing).

    python benchmarks/pd_transfer.py [--tokens 4096] [--reps 5] [--out FILE] [--note TEXT]
"""

from __future__ import annotations

import argparse
import json
import select
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import zmq

from banyan.cache.radix import RadixCache
from banyan.disagg.mooncake_transfer import MooncakeTransfer
from banyan.disagg.sink import KVSink
from banyan.disagg.source import KVSource
from banyan.mem.allocator import SlotAllocator
from banyan.mem.kv_pool import KVPool
from banyan.sampling.params import SamplingParams
from banyan.scheduler.memory import KVManager
from banyan.scheduler.request import Request

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64
IDENTITY = "pd-transfer-benchmark"


def make_pool(tokens: int, seed: int | None) -> KVPool:
    pool = KVPool(LAYERS, tokens + 2, KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        for t in (*pool.k, *pool.v):
            t[1:tokens + 1] = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen)
    return pool


def source(ns: argparse.Namespace) -> int:
    pool = make_pool(ns.tokens, seed=0)
    allocator = SlotAllocator(pool.num_slots)
    cache = RadixCache(allocator)
    slots = allocator.alloc(ns.tokens)
    assert slots == list(range(1, ns.tokens + 1))
    cache.insert(list(range(ns.tokens)), slots)
    mooncake = MooncakeTransfer(ns.host, pool) if ns.backend == "mooncake" else None
    kv = KVSource(zmq.Context.instance(), f"tcp://{ns.host}:0", pool, cache, IDENTITY, mooncake)
    raw = socket.create_server((ns.host, 0))
    payload = bytes(pool.bytes_per_slot * ns.tokens)
    print(json.dumps({"kv_addr": kv.address, "raw": raw.getsockname()[1]}), flush=True)
    while True:  # until killed
        ready, _, _ = select.select([raw, sys.stdin], [], [], 0.001)
        if sys.stdin in ready and not sys.stdin.readline():
            return 0
        if raw in ready:
            conn, _ = raw.accept()
            with conn:
                while (ask := conn.recv(8)):
                    conn.sendall(memoryview(payload)[: int.from_bytes(ask, "little")])
        kv.serve()


def sink(ns: argparse.Namespace) -> int:
    info = json.loads(ns.peer)
    pool = make_pool(ns.tokens, seed=None)
    want = make_pool(ns.tokens, seed=0)
    mooncake = MooncakeTransfer(ns.host, pool) if ns.backend == "mooncake" else None
    ctx = zmq.Context.instance()
    kv_s, raw_s = [], []
    nbytes = pool.bytes_per_slot * ns.tokens
    for _ in range(ns.reps + 1):  # the first: connections and handshakes
        allocator = SlotAllocator(pool.num_slots)
        manager = KVManager(allocator, RadixCache(allocator), num_rows=2)
        end = KVSink(ctx, manager, pool, IDENTITY, 60.0, mooncake)
        req = Request("r", list(range(ns.tokens + 1)), SamplingParams(), 1)
        t0 = time.perf_counter()
        assert not end.start([req], info["kv_addr"])
        while not end.collect(block_s=0.001):
            pass
        kv_s.append(time.perf_counter() - t0)
        assert end.stats.received_tokens == ns.tokens and end.stats.failed == 0, end.stats
        slots = manager.cache.match_prefix(list(range(ns.tokens))).slots
        index = torch.tensor(slots)
        for layer in range(LAYERS):
            assert torch.equal(pool.k[layer][index], want.k[layer][1:ns.tokens + 1])
            assert torch.equal(pool.v[layer][index], want.v[layer][1:ns.tokens + 1])
        end.close()
        buffer = bytearray(nbytes)
        with socket.create_connection((info["host"], info["raw"])) as conn:
            t0 = time.perf_counter()
            conn.sendall(nbytes.to_bytes(8, "little"))
            view, got = memoryview(buffer), 0
            while got < nbytes:
                got += conn.recv_into(view[got:])
            raw_s.append(time.perf_counter() - t0)
    print(json.dumps({"bytes": nbytes, "kv_s": kv_s[1:], "raw_s": raw_s[1:]}), flush=True)
    return 0


def measure(ns: argparse.Namespace, backend: str, src_host: str, dst_host: str,
            wrap: Any) -> dict[str, Any]:
    me = [sys.executable, __file__, "--tokens", str(ns.tokens), "--reps", str(ns.reps),
          "--backend", backend]
    src = subprocess.Popen(wrap(0, [*me, "--role", "source", "--host", src_host]),
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert src.stdout is not None
        peer = json.loads(src.stdout.readline())
        peer["host"] = src_host
        done = subprocess.run(wrap(1, [*me, "--role", "sink", "--host", dst_host,
                                       "--peer", json.dumps(peer)]),
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-3000:])
        out = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        src.kill()
        src.wait()
    kv, raw = statistics.median(out["kv_s"]), statistics.median(out["raw_s"])
    return {"backend": backend, "bytes": out["bytes"], "kv_median_s": kv,
            "raw_median_s": raw, "kv_GBps": out["bytes"] / kv / 1e9,
            "raw_GBps": out["bytes"] / raw / 1e9, "fraction_of_raw": raw / kv,
            "kv_s": out["kv_s"], "raw_s": out["raw_s"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--backends", default="zmq,mooncake")
    ap.add_argument("--role", choices=["source", "sink"], default=None)
    ap.add_argument("--backend", default="zmq")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--peer", default="")
    ap.add_argument("--note", default="")
    ap.add_argument("--out", default=None)
    ns = ap.parse_args(argv)
    if ns.role == "source":
        return source(ns)
    if ns.role == "sink":
        return sink(ns)
    from banyan.bench import netns
    from banyan.bench.offline import command_line, machine_info

    rows = []
    for backend in ns.backends.split(","):
        row = measure(ns, backend, "127.0.0.1", "127.0.0.1", lambda i, cmd: cmd)
        rows.append({"path": "loopback", **row})
    why_not = netns.available()
    if why_not is None:
        with netns.Hosts(2) as hosts:
            for backend in ns.backends.split(","):
                row = measure(ns, backend, hosts.address(0), hosts.address(1), hosts.run)
                rows.append({"path": "veth across namespaces", **row})
    for r in rows:
        print(f"{r['path']:24s} {r['backend']:9s} {r['kv_GBps']:.2f} GB/s vs plain socket "
              f"{r['raw_GBps']:.2f} GB/s: {r['fraction_of_raw']:.2f}x", flush=True)
    out = {"benchmark": "pd_transfer", "command": command_line(),
           "machine": machine_info(), "note": ns.note, "tokens": ns.tokens,
           "netns": why_not or "yes", "results": rows}
    if ns.out:
        Path(ns.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
