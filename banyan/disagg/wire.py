"""What a decode worker and a prefill worker say to each other over the KV transfer socket.

The decode worker asks (`KVFetch`: these prompt tokens, from this position, under this cache
namespace); the prefill worker answers with one `KVReply` header frame and, when it has any of
them, either one frame of raw K/V bytes laid out [layers, 2 (k, v), tokens, kv_heads, head_dim]
in the pool's dtype (the zmq backend), or nothing more, having written them into the decode
worker's pool with Mooncake's transfer engine first (the mooncake backend). msgpack headers
(never pickle), the payload as it lies in memory.

Tokens are named by their ids, not by a handle into the prefill worker's memory: the prefill
worker finds them in its prefix cache, so a reply can never point at slots reused meanwhile, and
a prefix evicted there is simply answered shorter (the decode worker computes the rest).
"""

from __future__ import annotations

import msgspec


class KVFetch(msgspec.Struct, tag="fetch"):
    room: int  # the decode worker's id for this transfer, echoed in the reply
    tokens: list[int]  # the prompt tokens whose K/V is wanted, from position 0
    start: int  # the decode worker has [0, start) already: send [start, len(tokens))
    namespace: str | None = None  # cache_salt: the cache keeps namespaces apart
    identity: str = ""  # the decode worker's model identity (model, dtype, KV layout)
    # The mooncake backend: write the K/V into the decode worker's pool instead of replying
    # with it. Its transfer engine's session, the base addresses of its pool's regions
    # (`KVPool.regions`), and the slots reserved for tokens[start:]; and how long it still
    # waits (no write after that).
    session: str = ""
    dest_regions: list[int] = []
    dest_slots: list[int] = []
    expires_in: float = 0.0


class KVReply(msgspec.Struct, tag="reply"):
    room: int
    start: int
    count: int  # tokens of K/V sent: [start, start + count), in the payload frame (zmq) or
    # written into the first `count` dest_slots (mooncake); 0: nothing
    error: str | None = None  # the request was refused (another model); count is 0 then
