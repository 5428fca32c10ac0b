from banyan.cache.base import InsertResult, MatchResult, PrefixCache
from banyan.cache.integrity import IntegrityError, check_integrity
from banyan.cache.no_cache import NoPrefixCache
from banyan.cache.radix import MissCause, RadixCache, RadixMatchResult, RadixStats

__all__ = [
    "InsertResult",
    "IntegrityError",
    "MatchResult",
    "MissCause",
    "NoPrefixCache",
    "PrefixCache",
    "RadixCache",
    "RadixMatchResult",
    "RadixStats",
    "check_integrity",
]
