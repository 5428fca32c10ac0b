"""What a decode worker and a prefill worker say to each other over the KV transfer socket.

The decode worker asks (`KVFetch`: these prompt tokens, from this position, under this cache
namespace); the prefill worker answers with one `KVReply` header frame and, when it has any of
them, one frame of raw K/V bytes laid out [layers, 2 (k, v), tokens, kv_heads, head_dim] in the
pool's dtype. msgpack headers (never pickle), the payload as it lies in memory.

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


class KVReply(msgspec.Struct, tag="reply"):
    room: int
    start: int
    count: int  # tokens of K/V in the payload frame: [start, start + count) (0: no frame)
    error: str | None = None  # the request was refused (another model); count is 0 then
