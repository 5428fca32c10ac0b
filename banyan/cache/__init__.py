from banyan.cache.base import InsertResult, MatchResult, PrefixCache
from banyan.cache.no_cache import NoPrefixCache

__all__ = ["InsertResult", "MatchResult", "NoPrefixCache", "PrefixCache"]
