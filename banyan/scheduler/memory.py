"""KV memory on the scheduler's side: slots (with prefix-cache eviction as the fallback), table
rows, and the request-level cache operations (match on admission, cache or free on release).

Index ranges of a running request's `slots` (what is whose):

    [0, locked_len)            owned by the prefix cache, locked by this request
    [locked_len, len(slots))   owned by the request; freed or offered to the cache on release

A decoding request also holds `decode_run`: slots taken as one run for its next tokens (up to
DECODE_RUN), because one slot per request per step would interleave the requests' K/V and
attention would read every decode token from a different place (measured: 5-7% of a decode
step at 64 x 256 tokens). These runs count as available memory: they are handed back before any
allocation would fail or evict cache, so admission and retraction see what they would without.
"""

from __future__ import annotations

from collections.abc import Iterable

from banyan.cache.base import InsertResult, LowerTier, MatchResult, PrefixCache
from banyan.mem.allocator import SlotAllocator
from banyan.scheduler.request import Request

DECODE_RUN = 16  # decode slots a request takes at a time


class KVManager:
    def __init__(self, allocator: SlotAllocator, cache: PrefixCache, num_rows: int,
                 tier: LowerTier | None = None) -> None:
        self.allocator = allocator
        self.cache = cache
        self.tier = tier  # a KV store under the prefix cache (HiCache), or None
        self.num_rows = num_rows
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self._with_runs: set[Request] = set()  # requests holding a decode run
        # Prompt tokens looked up in / served from the prefix cache at first admission.
        self.prefix_queried = 0
        self.prefix_hit = 0
        self.tier_loaded = 0  # tokens loaded from the tier into the pool
        self._reserved: dict[int, list[int]] = {}  # reservation id -> slots awaiting K/V
        self._next_reservation = 0

    @property
    def available(self) -> int:
        """Slots a new allocation could get: free now, in decode runs, or freed by evicting
        unlocked cache."""
        return self.free_slots + self.cache.evictable_size

    @property
    def free_slots(self) -> int:
        """Slots holding no KV: on the free list or in a request's decode run (what a KV usage
        figure should count as free)."""
        return self.allocator.num_free + sum(len(r.decode_run) for r in self._with_runs)

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    def alloc_slots(self, n: int) -> list[int] | None:
        if n > self.allocator.num_free:
            self.drop_decode_runs()
        short = n - self.allocator.num_free
        if short > 0:
            self.cache.evict(short)
        return self.allocator.alloc(n)

    def alloc_for(self, req: Request, n: int) -> list[int] | None:
        """Slots for n new tokens of req. A single token (a decode, or a prompt's last) comes
        from the request's decode run, refilled with free slots when empty (never by evicting
        cache for it)."""
        if n != 1:
            return self.alloc_slots(n)
        if req.decode_run:
            if len(req.decode_run) == 1:
                self._with_runs.discard(req)
            return [req.decode_run.pop()]
        run = min(DECODE_RUN, req.max_new_tokens - len(req.output_ids))
        if run > 1 and self.allocator.num_free >= run:
            slots = self.allocator.alloc(run)
            assert slots is not None
            req.decode_run = slots[:0:-1]  # popped from the end: ascending
            self._with_runs.add(req)
            return slots[:1]
        return self.alloc_slots(1)

    def drop_decode_runs(self) -> None:
        for req in self._with_runs:
            self._drop_run(req)
        self._with_runs.clear()

    def _drop_run(self, req: Request) -> None:
        self.allocator.free(req.decode_run)
        req.decode_run = []

    @property
    def free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> int:
        return self._free_rows.pop()

    def match(self, req: Request) -> None:
        """Point a request that holds no KV at the longest cached prefix of its tokens, locked.
        The last token is never matched: its logits must be computed. Nor is anything for a
        request that wants its prompt's logprobs: the cache keeps K/V, not logits, so its prompt
        is recomputed (it still offers its KV to the cache for others)."""
        assert not req.slots and req.cache_handle is None
        tokens = [] if req.wants_prompt_logprobs else req.token_ids(0, req.num_tokens - 1)
        result = self.cache.match_prefix(tokens, req.namespace, count_stats=False)
        if self.tier is not None and len(result.slots) < self.cache.aligned_len(len(tokens)):
            result = self._load_from_tier(tokens, req.namespace, result)
        self.cache.lock(result.handle)
        req.cache_handle = result.handle
        req.slots = list(result.slots)
        req.locked_len = req.written = len(result.slots)

    def _load_from_tier(self, tokens: list[int], namespace: str | None,
                        device: MatchResult) -> MatchResult:
        """Extend a device match with the blocks the tier holds: load them into reserved slots
        and give them to the prefix cache, as if this request had computed them. Only free
        slots and evictable cache are used, and only when loading beats recomputing."""
        assert self.tier is not None
        start = len(device.slots)
        n = self.cache.aligned_len(start + self.tier.loadable(tokens, namespace, start))
        reserved = self.reserve_prefix(tokens[:n], namespace) if n > start else None
        if reserved is None:
            return device
        reservation, matched, slots = reserved
        loaded = self.tier.load(tokens, namespace, start, slots)
        self.tier_loaded += self.fill_reserved(reservation, tokens, namespace, matched, loaded)
        return self.cache.match_prefix(tokens, namespace, count_stats=False)

    def reserve_prefix(self, tokens: list[int], namespace: str | None
                       ) -> tuple[int, MatchResult, list[int]] | None:
        """For K/V of `tokens` that will arrive from elsewhere (a prefill worker): lock the
        cached prefix, and take slots for the rest (from free slots and evictable cache only).
        Returns (reservation id, the locked match, the slots), or None when the cache already
        holds them all or memory is short. End it with `fill_reserved`."""
        matched = self.cache.match_prefix(tokens, namespace, count_stats=False)
        n = self.cache.aligned_len(len(tokens)) - len(matched.slots)
        if n <= 0:
            return None
        self.cache.lock(matched.handle)
        slots = self.alloc_slots(n) if self.available >= n else None
        if slots is None:
            self.cache.unlock(matched.handle)
            return None
        rid = self._next_reservation
        self._next_reservation += 1
        self._reserved[rid] = slots
        return rid, matched, slots

    def fill_reserved(self, reservation: int, tokens: list[int], namespace: str | None,
                      matched: MatchResult, filled: int) -> int:
        """The first `filled` reserved slots now hold the K/V of the tokens after the match:
        give them to the prefix cache (as `insert` takes them), free the rest and the lock.
        filled = 0 cancels the reservation. Returns the tokens given to the cache."""
        slots = self._reserved.pop(reservation)
        start = len(matched.slots)
        filled = self.cache.aligned_len(start + filled) - start
        self.allocator.free(slots[max(filled, 0):])
        if filled > 0:
            result = self.cache.insert(tokens[: start + filled], matched.slots + slots[:filled],
                                       namespace)
            self.allocator.free(slots[: max(min(result.cached_len - start, filled), 0)])
        self.cache.unlock(matched.handle)
        return max(filled, 0)

    def count_admission(self, req: Request) -> None:
        self.prefix_queried += len(req.prompt_ids)
        self.prefix_hit += req.cached_tokens

    def explain(self, tokens: list[int], namespace: str | None = None) -> dict[str, object]:
        """How much of `tokens` the cache holds now, and (radix cache) why the rest missed:
        "evicted" (it was cached and has been evicted) or "unseen"."""
        result = self.cache.match_prefix(tokens, namespace, count_stats=False)
        out: dict[str, object] = {
            "matched": len(result.slots), "query": len(tokens),
            "miss_cause": getattr(result, "miss_cause", "unseen" if len(result.slots) <
                                  len(tokens) else "none")}
        if self.tier is not None:  # what a request would load from the tier past the match
            out["tier_tokens"] = held = self.tier.held(tokens, namespace, len(result.slots))
            if held:
                out["miss_cause"] = "in_tier"
        return out

    def unmatch(self, req: Request) -> None:
        """Undo `match` for a request that was not admitted after all."""
        self.cache.unlock(req.cache_handle)
        req.cache_handle = None
        req.slots = []
        req.locked_len = req.written = 0

    def cache_unfinished(self, req: Request, n: int) -> None:
        """After a prefill chunk that ends at token n: hand the computed prefix to the cache so
        others can share it, and move the request onto the cache's copy (its duplicates are
        freed). Slots past n (a step still in flight) stay the request's own."""
        if not self.cache.keeps_prefixes:
            return
        tokens = req.token_ids(0, n)
        result = self._offer(tokens, req.slots[:n], req.namespace)
        self.allocator.free(req.slots[req.locked_len : result.cached_len])
        self.cache.lock(result.handle)
        self.cache.unlock(req.cache_handle)
        req.cache_handle = result.handle
        shared = self.cache.match_prefix(tokens, req.namespace, count_stats=False).slots
        if shared != req.slots[: len(shared)]:
            req.row_synced = 0  # the table row must be rewritten with the cache's slots
        req.slots = shared + req.slots[len(shared) :]
        req.locked_len = len(shared)

    def _offer(self, tokens: list[int], slots: list[int], namespace: str | None) -> InsertResult:
        """Computed K/V (a prompt chunk, or a request giving its KV up) offered to the prefix
        cache, and written through to the tier at once, while the slots still hold it: replicas
        sharing the tier may want a prompt before its request ends."""
        if self.tier is not None:
            self.tier.save(tokens, namespace, slots)
        return self.cache.insert(tokens, slots, namespace)

    def drop_uncomputed(self, req: Request, keep: int) -> None:
        """Free req's slots from token `keep` on, given to a step that failed (and any launched
        after it): their K/V is garbage, so `release` must not offer them to the cache."""
        assert keep >= req.locked_len, "a failed step's slots are the request's own"
        self.drop_tail(req, len(req.slots) - keep)

    def drop_tail(self, req: Request, n: int) -> None:
        """Hand back req's last n slots (rejected speculative tokens, or a failed step's)."""
        if n <= 0:
            return
        self.allocator.free(req.slots[len(req.slots) - n :])
        del req.slots[len(req.slots) - n :]
        req.row_synced = min(req.row_synced, len(req.slots))
        req.written = min(req.written, len(req.slots))

    def release(self, req: Request) -> None:
        """Give up a request's KV (finished, aborted or retracted): its computed tokens are
        offered to the cache, the rest freed, its lock and row dropped."""
        if req.slots:
            # Only K/V that collected steps wrote is cached; a step in flight (a request
            # retracted under overlap) may still be writing the rest.
            n = max(min(req.num_computed, req.written), req.locked_len)
            result = self._offer(req.token_ids(0, n), req.slots[:n], req.namespace)
            self.allocator.free(req.slots[req.locked_len : max(result.cached_len, req.locked_len)])
            # A partial last page is never cached: it stays ours to free.
            self.allocator.free(req.slots[max(self.cache.aligned_len(n), req.locked_len) :])
        if req.decode_run:
            self._drop_run(req)
            self._with_runs.discard(req)
        if req.cache_handle is not None:
            self.cache.unlock(req.cache_handle)
        if req.row is not None:
            self._free_rows.append(req.row)
        req.slots = []
        req.locked_len = 0
        req.cache_handle = None
        req.row = None
        req.row_synced = req.written = 0

    def check_integrity(self, running: list[Request], ended: Iterable[Request] = ()) -> None:
        """free + cached + held by requests (decode runs included; `ended`: requests whose KV
        waits for a step in flight) + reserved for arriving K/V = every slot, each in exactly
        one place."""
        free = self.allocator.free_set()
        cached = self.cache.cached_slots()
        holders = [*running, *ended]
        held = [s for r in holders for s in (*r.slots[r.locked_len :], *r.decode_run)]
        held += [s for slots in self._reserved.values() for s in slots]
        everything = list(free) + cached + held
        assert len(free) == self.allocator.num_free, "a slot is twice in the free list"
        assert len(everything) == self.capacity, (
            f"slots leaked or doubled: free {len(free)} + cached {len(cached)} + held "
            f"{len(held)} != capacity {self.capacity}"
        )
        assert len(set(everything)) == self.capacity, "a slot is in two places"
        assert len(self._free_rows) + sum(r.row is not None for r in holders) == self.num_rows
        assert self._with_runs == {r for r in holders if r.decode_run}, "decode run set drifted"
