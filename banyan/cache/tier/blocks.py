"""Block keys of the KV tier: a chained hash over fixed-size token blocks.

A sequence's KV is stored in blocks of `block_tokens` tokens at absolute positions (block j holds
tokens [j*B, (j+1)*B)). Block j's key hashes block j-1's key with block j's tokens, and the
chain starts from the model's identity and the request's namespace (cache_salt), so a key names
the whole prefix up to the block's end, for this model, dtype and tenant only (the prefix hashing
of vLLM's and SGLang's KV stores). 128-bit xxh3: collisions are not a practical concern, and a
block file also carries its own tokens, which are compared on every load.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash


def chain_seed(identity: str, namespace: str | None) -> bytes:
    """The key before block 0: the model identity and the namespace (None and "" differ)."""
    ns = "\x00none" if namespace is None else "\x01" + namespace
    return xxhash.xxh3_128_digest(f"{identity}\x00{ns}".encode())


def block_keys(seed: bytes, tokens: Sequence[int], block_tokens: int,
               first: int = 0, count: int | None = None) -> list[str]:
    """Hex keys of blocks first..first+count-1 (default: every full block of `tokens`). Keys
    chain from block 0, so the blocks before `first` are hashed but not returned."""
    full = len(tokens) // block_tokens
    last = full if count is None else min(full, first + count)
    keys: list[str] = []
    prev = seed
    for j in range(last):
        block = array("q", tokens[j * block_tokens:(j + 1) * block_tokens]).tobytes()
        prev = xxhash.xxh3_128_digest(prev + block)
        if j >= first:
            keys.append(prev.hex())
    return keys
