"""A KV tier under the prefix cache (HiCache): blocks saved to a store, loaded back on a hit."""

from banyan.cache.tier.file_store import FileStore
from banyan.cache.tier.kv_tier import KVTier, TierStats

__all__ = ["FileStore", "KVTier", "TierStats"]
