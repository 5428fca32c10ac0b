"""The decode worker's side of a KV transfer: fetch a prompt's K/V from the prefill worker that
computed it, then queue the request as a prefix-cache hit.

A request that names a prefill worker (`kv_source`) waits here, outside the scheduler, while its
K/V travels: the cached prefix this worker already holds is locked and slots for the rest are
reserved (`KVManager.reserve_prefix`), so only the delta moves and the memory cannot run out
after the bytes arrive. When they do, they are copied into the reserved slots and given to the
prefix cache; the scheduler then admits the request like any other and finds the whole prompt
cached but its last token, which it computes (that step samples the first token, so outputs are
exactly the colocated engine's). Other requests keep decoding meanwhile.

Nothing here can lose a request: a reply that is short (evicted over there), refused, malformed
or late (`timeout_s`: the prefill worker died) only means this worker computes the missing part
itself. Every path ends the reservation, so no slot leaks.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

import msgspec
import zmq

from banyan.cache.base import MatchResult
from banyan.disagg.mooncake_transfer import MooncakeTransfer
from banyan.disagg.wire import KVFetch, KVReply
from banyan.mem.kv_pool import KVPool
from banyan.scheduler.memory import KVManager
from banyan.scheduler.request import Request

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SinkStats:
    transfers: int = 0  # fetches sent
    received_tokens: int = 0
    received_bytes: int = 0
    transfer_seconds: float = 0.0  # fetch sent to K/V in the pool, summed
    copy_seconds: float = 0.0  # of which: copying into the pool on the engine thread
    short_tokens: int = 0  # asked for, not received: computed here
    failed: int = 0  # refused, malformed or timed-out transfers (computed here)
    local_hits: int = 0  # requests whose prompt this worker held already: nothing fetched


@dataclass(slots=True)
class _Transfer:
    reservation: int
    requests: list[Request]  # the samples of one user request (one prompt)
    tokens: list[int]  # prompt tokens whose K/V is wanted (from position 0)
    namespace: str | None
    matched: MatchResult  # the locked local prefix
    slots: list[int]  # reserved for tokens[len(matched.slots):]
    started: float  # time.monotonic() when the fetch was sent
    remote: str  # the prefill worker's K/V address


class KVSink:
    def __init__(self, ctx: zmq.Context, kv: KVManager, pool: KVPool, identity: str,
                 timeout_s: float, mooncake: MooncakeTransfer | None = None) -> None:
        self.ctx = ctx
        self.mooncake = mooncake  # the mooncake backend: the prefill worker writes our slots
        self.kv = kv
        self.pool = pool
        self.identity = identity
        self.timeout_s = timeout_s
        self.stats = SinkStats()
        self._sockets: dict[str, zmq.Socket] = {}  # prefill worker address -> DEALER
        self._poller = zmq.Poller()
        # Their connections' disconnect events: a prefill worker that dies (kill -9 closes its
        # sockets; a dead host stops answering heartbeats) fails its transfers at once, not
        # after the timeout.
        self._monitors: dict[zmq.Socket, str] = {}
        self._transfers: dict[int, _Transfer] = {}  # room -> transfer
        # mooncake: transfers given up (aborted, timed out) whose slots the prefill worker may
        # still write: kept reserved until its reply comes, or until it cannot write any more.
        self._quarantined: dict[int, _Transfer] = {}
        self._room = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(KVReply)

    def __len__(self) -> int:
        return sum(len(t.requests) for t in self._transfers.values())

    @property
    def pending(self) -> bool:
        """Transfers in flight, or given up and not yet safe to free (collect ends them)."""
        return bool(self._transfers or self._quarantined)

    def rids(self) -> list[str]:
        return [r.rid for t in self._transfers.values() for r in t.requests]

    def start(self, requests: list[Request], remote: str) -> list[Request]:
        """Fetch the K/V of the requests' (shared) prompt from `remote`; returns them at once
        when there is nothing to fetch (all cached here, prompt logprobs wanted, no memory)."""
        req = requests[0]
        if req.wants_prompt_logprobs:  # the prompt is recomputed anyway (KVManager.match)
            return requests
        tokens = req.token_ids(0, req.num_tokens - 1)  # the last one is computed here
        reserved = self.kv.reserve_prefix(tokens, req.namespace)
        if reserved is None:
            self.stats.local_hits += 1
            return requests
        reservation, matched, slots = reserved
        self._room += 1
        transfer = _Transfer(reservation, requests, tokens[: len(matched.slots) + len(slots)],
                             req.namespace, matched, slots, time.monotonic(), remote)
        fetch = KVFetch(self._room, transfer.tokens, len(matched.slots), req.namespace,
                        self.identity)
        if self.mooncake is not None:
            fetch.session = self.mooncake.session
            fetch.dest_regions = self.mooncake.region_ptrs
            fetch.dest_slots, fetch.expires_in = slots, self.timeout_s
        try:
            self._socket(remote).send(self._encoder.encode(fetch), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.warning("KV fetch from %s not sent (%s): computing the prompt here", remote,
                           exc)
            self._end(transfer, 0)
            return requests
        self._transfers[self._room] = transfer
        self.stats.transfers += 1
        return []

    def _socket(self, remote: str) -> zmq.Socket:
        sock = self._sockets.get(remote)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)  # a peer host gone silent counts as gone
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
            monitor = self._monitor(sock)
            sock.connect(remote)
            self._sockets[remote] = sock
            self._monitors[monitor] = remote
            self._poller.register(sock, zmq.POLLIN)
            self._poller.register(monitor, zmq.POLLIN)
        return sock

    def _monitor(self, sock: zmq.Socket) -> zmq.Socket:
        """A PAIR receiving sock's disconnect events. libzmq sends them from its I/O thread and
        blocks while they find no room: a unique address (pyzmq's default names it by file
        descriptor, reused once closed) and no high-water mark keep that send from blocking."""
        address = f"inproc://banyan-kv-sink-monitor-{uuid.uuid4().hex}"
        sock.monitor(address, zmq.EVENT_DISCONNECTED)
        monitor = self.ctx.socket(zmq.PAIR)
        monitor.setsockopt(zmq.LINGER, 0)
        monitor.setsockopt(zmq.RCVHWM, 0)
        monitor.connect(address)
        return monitor

    def collect(self, block_s: float = 0.0) -> list[Request]:
        """Requests whose K/V arrived (or whose transfer failed or timed out: they compute it),
        waiting up to block_s for a reply when nothing is ready."""
        ready: list[Request] = []
        if not self._transfers and not self._quarantined:
            return ready
        gone: set[str] = set()
        for sock, _ in self._poller.poll(int(block_s * 1000)):
            while True:
                try:
                    frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                if sock in self._monitors:
                    gone.add(self._monitors[sock])
                else:
                    ready += self._receive(frames)
        now = time.monotonic()
        for room, transfer in list(self._transfers.items()):
            if transfer.remote in gone or now > transfer.started + self.timeout_s:
                logger.warning("KV transfer from %s %s: computing the prompt here",
                               transfer.remote, "lost its connection"
                               if transfer.remote in gone else
                               f"timed out after {self.timeout_s:.1f} s")
                del self._transfers[room]
                self.stats.failed += 1
                ready += transfer.requests
                self._give_up(room, transfer)
        for room, transfer in list(self._quarantined.items()):
            # The prefill worker writes only within the first half of expires_in after it
            # got the fetch, and it got it after we sent it: past 2 x the timeout it cannot.
            if now > transfer.started + 2 * self.timeout_s:
                del self._quarantined[room]
                self._end(transfer, 0)
        return ready

    def _give_up(self, room: int, transfer: _Transfer) -> None:
        """End a transfer nobody waits for any more; with mooncake, only once the prefill
        worker can no longer write into its slots."""
        transfer.requests = []
        if self.mooncake is None:
            self._end(transfer, 0)
        else:
            self._quarantined[room] = transfer

    def _receive(self, frames: list[zmq.Frame]) -> list[Request]:
        try:
            reply = self._decoder.decode(frames[0].buffer)
        except msgspec.DecodeError:
            logger.warning("undecodable KV reply dropped")
            return []
        transfer = self._transfers.pop(reply.room, None)
        if transfer is None:  # its requests were aborted, or it timed out: too late
            late = self._quarantined.pop(reply.room, None)
            if late is not None:
                self._end(late, 0)  # written or not, the slots are ours again
            return []
        start = len(transfer.matched.slots)
        count = reply.count
        payload = frames[1].buffer if len(frames) > 1 else b""
        expected = 0 if self.mooncake is not None else count * self.pool.bytes_per_slot
        bad = reply.error or reply.start != start or not 0 <= count <= len(transfer.slots) or \
            len(payload) != expected
        if bad:
            logger.warning("KV transfer from %s failed (%s): computing the prompt here",
                           transfer.remote, reply.error or "a reply that does not fit")
            self.stats.failed += 1
            count = 0
        if count and self.mooncake is None:
            t0 = time.perf_counter()
            self.pool.scatter(self.pool.unpack(payload, count), transfer.slots[:count])
            self.stats.copy_seconds += time.perf_counter() - t0
        self.stats.received_bytes += count * self.pool.bytes_per_slot
        self._end(transfer, count)
        return transfer.requests

    def _end(self, transfer: _Transfer, filled: int) -> None:
        taken = self.kv.fill_reserved(transfer.reservation, transfer.tokens, transfer.namespace,
                                      transfer.matched, filled)
        self.stats.received_tokens += taken
        for req in transfer.requests:
            req.transferred = taken
        self.stats.short_tokens += len(transfer.slots) - taken
        self.stats.transfer_seconds += time.monotonic() - transfer.started

    def remove(self, rid: str) -> Request | None:
        """Take an aborted request out; its transfer ends (unfilled) when it was the last."""
        for room, transfer in self._transfers.items():
            for req in transfer.requests:
                if req.rid == rid:
                    transfer.requests.remove(req)
                    if not transfer.requests:
                        del self._transfers[room]
                        self._give_up(room, transfer)
                    return req
        return None

    def close(self) -> None:
        for transfers in (self._transfers, self._quarantined):
            for room in list(transfers):
                self._end(transfers.pop(room), 0)
        # Monitoring stops before its PAIR closes: an event sent to a PAIR whose peer is gone
        # blocks libzmq's I/O thread for good, and with it every socket of the context (seen
        # when the prefill worker closed while the DEALER was being reaped).
        for sock in self._sockets.values():
            sock.disable_monitor()
        for sock in (*self._monitors, *self._sockets.values()):
            sock.close(linger=0)
        self._sockets.clear()
        self._monitors.clear()
