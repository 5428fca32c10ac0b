"""The prefill worker's side of a KV transfer: answer decode workers' fetches from the prefix
cache.

A prefill worker serves each request as usual (its prompt, one token) and keeps the prompt's K/V
in its prefix cache. A decode worker then asks for that K/V by token ids (`KVFetch`); `serve`
finds the longest cached prefix, copies the asked part out of the pool and sends it. It runs on
the engine thread between steps (the only thread that may read the pool while the cache could
evict), and never blocks: fetches are taken without waiting, replies are queued by ZMQ.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import msgspec
import zmq

from banyan.cache.base import PrefixCache
from banyan.disagg.mooncake_transfer import MooncakeTransfer
from banyan.disagg.wire import KVFetch, KVReply
from banyan.mem.kv_pool import KVPool

logger = logging.getLogger(__name__)

MAX_FETCHES_PER_TURN = 64  # so a flood of fetches cannot starve the step


@dataclass(slots=True)
class SourceStats:
    fetches: int = 0
    sent_tokens: int = 0
    sent_bytes: int = 0
    short_tokens: int = 0  # asked for but no longer cached (evicted): the decode side computes
    refused: int = 0  # fetches for another model
    gather_seconds: float = 0.0  # copying out of the pool (zmq) or writing to the peer (mooncake)


class KVSource:
    def __init__(self, ctx: zmq.Context, bind: str, pool: KVPool, cache: PrefixCache,
                 identity: str, mooncake: MooncakeTransfer | None = None) -> None:
        self.pool = pool
        self.mooncake = mooncake
        self.cache = cache
        self.identity = identity
        self.stats = SourceStats()
        self.socket = ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a gone peer raises, never blocks
        if bind.endswith(":0"):
            port = self.socket.bind_to_random_port(bind.rsplit(":", 1)[0])
            bind = f"{bind.rsplit(':', 1)[0]}:{port}"
        else:
            self.socket.bind(bind)
        self.address = bind
        self._decoder = msgspec.msgpack.Decoder(KVFetch)
        self._encoder = msgspec.msgpack.Encoder()

    def serve(self) -> int:
        """Answer the fetches waiting now; returns how many."""
        served = 0
        while served < MAX_FETCHES_PER_TURN:
            try:
                peer, data = self.socket.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            except ValueError:  # not [peer, one frame]: not ours
                continue
            served += 1
            try:
                fetch = self._decoder.decode(data.buffer)
            except msgspec.DecodeError:
                logger.warning("undecodable KV fetch dropped")
                continue
            self._answer(peer.bytes, fetch)
        return served

    def _answer(self, peer: bytes, fetch: KVFetch) -> None:
        received = time.monotonic()
        self.stats.fetches += 1
        refusal = None
        if fetch.identity != self.identity:
            refusal = "the prefill worker serves another model or KV dtype"
        elif fetch.session and self.mooncake is None:
            refusal = "the prefill worker has no Mooncake transfer engine (transfer backend zmq)"
        if refusal is not None:
            self.stats.refused += 1
            self._send(peer, KVReply(fetch.room, fetch.start, 0, error=refusal))
            return
        t0 = time.perf_counter()
        result = self.cache.match_prefix(fetch.tokens, fetch.namespace, count_stats=False)
        have = len(result.slots)
        wanted = len(fetch.tokens) - fetch.start
        count = max(have - fetch.start, 0)
        self.stats.short_tokens += max(wanted - count, 0)
        if count == 0:
            self._send(peer, KVReply(fetch.room, fetch.start, 0))
            return
        if fetch.session:
            self._write(peer, fetch, result.slots[fetch.start:have], received)
            return
        kv = self.pool.gather(result.slots[fetch.start:have])  # a copy: eviction may follow
        self.stats.gather_seconds += time.perf_counter() - t0
        payload = kv.view(-1).numpy()  # uint8: the pool's raw bytes
        self._send(peer, KVReply(fetch.room, fetch.start, count), payload)
        self.stats.sent_tokens += count
        self.stats.sent_bytes += payload.nbytes

    def _write(self, peer: bytes, fetch: KVFetch, slots: list[int], received: float) -> None:
        """The mooncake backend: write into the decode worker's reserved slots, then reply. Not
        after half its wait is over: past its deadline it frees those slots for others."""
        assert self.mooncake is not None
        count = min(len(slots), len(fetch.dest_slots))
        if time.monotonic() - received > fetch.expires_in / 2:
            self._send(peer, KVReply(fetch.room, fetch.start, 0, error="fetch expired"))
            return
        t0 = time.perf_counter()
        if not self.mooncake.write(fetch.session, slots[:count], fetch.dest_regions,
                                   fetch.dest_slots[:count]):
            self._send(peer, KVReply(fetch.room, fetch.start, 0,
                                     error="the Mooncake write failed"))
            return
        self.stats.gather_seconds += time.perf_counter() - t0
        self.stats.sent_tokens += count
        self.stats.sent_bytes += count * self.pool.bytes_per_slot
        self._send(peer, KVReply(fetch.room, fetch.start, count))

    def _send(self, peer: bytes, reply: KVReply, payload: object = None) -> None:
        frames: list[object] = [peer, self._encoder.encode(reply)]
        if payload is not None:
            frames.append(payload)
        try:
            self.socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:  # the decode worker went away: its fetch times out there
            logger.warning("KV reply to a gone decode worker dropped: %s", exc)

    def close(self) -> None:
        self.socket.close(linger=0)

