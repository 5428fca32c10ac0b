"""Prompt lookup ("n-gram") proposals: when the last n tokens of a request appeared before in its
own prompt or output, guess that what followed them then follows them now.

No model, no state: a request that copies spans of its input (summaries, rewrites, code edits)
gets long runs accepted; one that does not simply gets no guesses. The longest suffix from
`max_n` down to `min_n` that matches wins, and among its matches the most recent one that is
followed by k tokens (the text being copied is usually the nearest one). The search runs at C
speed: the tokens are packed as 4-byte integers and `bytes.rfind` looks for the suffix (a hit
at an offset that is not a multiple of 4 straddles two tokens and is skipped).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from banyan.scheduler.request import Request

_ITEM = 4  # bytes per packed token id (array 'I' is 32-bit on every platform we build for)


class NgramProposer:
    def __init__(self, min_n: int = 2, max_n: int = 5) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"spec_ngram_min must be in [1, spec_ngram_max], got {min_n}..{max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, reqs: Sequence[Request], max_tokens: Sequence[int]) -> list[list[int]]:
        return [self.lookup(req.prompt_ids, req.output_ids, k)
                for req, k in zip(reqs, max_tokens, strict=True)]

    def forget(self, req: Request) -> None:
        pass  # nothing is kept per request

    def seconds_per_position(self, requests: int) -> float:
        return 0.0  # a lookup in the request's own text: next to nothing beside a forward

    def lookup(self, prompt: Sequence[int], output: Sequence[int], k: int) -> list[int]:
        """Up to k tokens following the most recent earlier occurrence of the longest suffix."""
        tokens = array("I", prompt)
        tokens.extend(output)
        total = len(tokens)
        if k <= 0 or total < self.min_n + 1:
            return []
        packed = tokens.tobytes()
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            suffix = packed[(total - n) * _ITEM :]
            # The most recent match that leaves k tokens to propose, else the latest of any
            # length (in a run of repeats the latest match is one token back: one guess).
            for end in (total - k, total - 1):
                start = _rfind_aligned(packed, suffix, end * _ITEM)
                if start >= 0:
                    return tokens[start + n : start + n + k].tolist()
        return []


def _rfind_aligned(packed: bytes, pattern: bytes, end: int) -> int:
    """Token index of the last occurrence of pattern ending by byte `end`, or -1 (hits that
    straddle two tokens are skipped)."""
    while end >= len(pattern):
        at = packed.rfind(pattern, 0, end)
        if at < 0:
            return -1
        if at % _ITEM == 0:
            return at // _ITEM
        end = at + len(pattern) - 1
    return -1
