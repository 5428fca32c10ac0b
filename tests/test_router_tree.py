"""The router's approximate tree, its keys and its policies, without processes: exact match
lengths, sizes and eviction order (fake clock), a property test against a naive model, and the
routing decisions of every policy."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from banyan.router.args import RouterArgs, normalize_url
from banyan.router.keys import RouteKey, ids_to_text, route_key
from banyan.router.policies import (
    CacheAware,
    Candidate,
    RandomChoice,
    RoundRobin,
    ShortestQueue,
    least_loaded,
    make_policy,
)
from banyan.router.tree import ApproxTree
from banyan.router.workers import parse_kv_usage


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


# ---- tree --------------------------------------------------------------------------------------


def test_match_per_tenant_and_split() -> None:
    tree = ApproxTree(FakeClock())
    tree.insert("hello world", "A")
    tree.insert("hello there", "B")  # splits "hello world" after "hello "
    tree.insert("help", "A")
    m = tree.match("hello wonder")
    assert m.key_len == 12
    assert m.lengths == {"A": 8, "B": 6}  # "hello wo" / "hello "
    assert tree.match("hello there!").lengths == {"A": 6, "B": 11}
    assert tree.match("help me").lengths == {"A": 4, "B": 3}
    assert tree.match("xyz").lengths == {}
    assert tree.match("").lengths == {}
    # Sizes count each tenant's distinct prefix symbols: A: "hello world" + "p"; B: "hello there".
    assert tree.sizes() == {"A": 12, "B": 11}
    tree.insert("hello world", "A")  # nothing new
    assert tree.size("A") == 12


def test_namespaces_are_separate() -> None:
    tree = ApproxTree()
    tree.insert("abc", "A", namespace="text")
    assert tree.match("abc", namespace="ids").lengths == {}
    assert tree.match("abc", namespace="text").lengths == {"A": 3}
    assert tree.size("A") == 3


def test_evict_lru_leaves_first() -> None:
    clock = FakeClock()
    tree = ApproxTree(clock)
    tree.insert("aaaa1111", "A")  # t=1
    tree.insert("aaaa2222", "A")  # t=2
    tree.insert("bbbb", "A")  # t=3
    tree.insert("aaaa1111", "B")  # B shares the nodes, with its own times
    assert tree.size("A") == 16
    # Over by 4: the oldest leaf of A ("1111", t=1) goes; B keeps it.
    assert tree.evict(12) == 4
    assert tree.size("A") == 12 and tree.size("B") == 8
    assert tree.match("aaaa1111").lengths == {"A": 4, "B": 8}
    assert tree.match("aaaa2222").lengths == {"A": 8, "B": 4}
    # Down to 4: A loses "2222" (t=2), then "aaaa" (now its leaf, last used at t=2), keeps
    # "bbbb" (t=3); B (8, over too) loses its leaf "1111".
    assert tree.evict(4) == 12
    assert tree.sizes() == {"A": 4, "B": 4}
    assert tree.match("bbbb").lengths == {"A": 4}
    assert tree.match("aaaa1111").lengths == {"B": 4}
    assert tree.evict(4) == 0


def test_evict_respects_recent_use() -> None:
    clock = FakeClock()
    tree = ApproxTree(clock)
    tree.insert("xx-old", "A")
    tree.insert("yy-new", "A")
    tree.insert("xx-old", "A")  # used again: now the newest
    tree.evict(6)
    assert tree.match("xx-old").lengths == {"A": 6}
    assert tree.match("yy-new").lengths == {}


def test_remove_tenant() -> None:
    tree = ApproxTree()
    tree.insert("shared prefix one", "A")
    tree.insert("shared prefix two", "B")
    tree.remove_tenant("A")
    assert tree.sizes() == {"B": 17}
    assert tree.match("shared prefix one").lengths == {"B": 14}
    tree.remove_tenant("B")
    assert tree.sizes() == {} and tree.match("shared").lengths == {}
    tree.remove_tenant("nobody")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("ABC"), st.text("ab", max_size=8)), max_size=30),
       st.lists(st.text("ab", max_size=9), max_size=10))
def test_tree_equals_naive_model(inserts: list[tuple[str, str]], queries: list[str]) -> None:
    """Without eviction: each tenant's match is its longest common prefix with any key it was
    sent, and its size is the number of distinct non-empty prefixes of those keys."""
    tree = ApproxTree()
    sent: dict[str, list[str]] = {}
    for tenant, key in inserts:
        tree.insert(key, tenant)
        if key:
            sent.setdefault(tenant, []).append(key)

    def lcp(a: str, b: str) -> int:
        pairs = enumerate(zip(a, b, strict=False))
        return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))

    for q in queries + [k for _, k in inserts]:
        expected = {t: max(lcp(q, k) for k in keys) for t, keys in sent.items()}
        assert tree.match(q).lengths == {t: n for t, n in expected.items() if n > 0}
    for tenant, keys in sent.items():
        assert tree.size(tenant) == len({k[:i] for k in keys for i in range(1, len(k) + 1)})
    limit = 3
    tree.evict(limit)
    for tenant in sent:
        assert tree.size(tenant) <= limit
        for q in queries:  # what is left is a part of what was sent
            assert tree.match(q).length(tenant) <= max(lcp(q, k) for k in sent[tenant])


# ---- keys --------------------------------------------------------------------------------------


def test_route_keys() -> None:
    assert route_key("/v1/completions", {"prompt": "hi there"}) == RouteKey("text", "hi there")
    assert route_key("/v1/completions", {"prompt": ["a", "b"]}) == RouteKey("text", "a")
    ids = route_key("/v1/completions", {"prompt": [5, 70000, 3]})
    assert ids == RouteKey("ids", "\x05\U00011170\x03") and len(ids) == 3
    assert route_key("/v1/completions", {"prompt": [[1, 2], [3]]}) == RouteKey("ids", "\x01\x02")
    assert route_key("/generate", {"input_ids": [1, 2]}) == RouteKey("ids", "\x01\x02")
    assert route_key("/generate", {"text": "x", "cache_salt": "t1"}) == RouteKey("text\x00t1", "x")
    chat = route_key("/v1/chat/completions", {"messages": [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "q"}]}]})
    assert chat == RouteKey("chat", "system\x1fsys\x1euser\x1fq\x1e")
    # A longer conversation extends the key of the shorter one.
    longer = route_key("/v1/chat/completions", {"messages": [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"}]})
    assert longer is not None and longer.text.startswith(chat.text)
    for bad in ({"prompt": []}, {"prompt": [1.5]}, {"prompt": [True]}, {"prompt": ""}, {},
                {"messages": "x"}, []):
        assert route_key("/v1/completions", bad) is None
    assert ids_to_text([0x110000 + 7]) == "\x07"  # folded, not an error


def test_parse_kv_usage_and_urls() -> None:
    text = ("# HELP banyan:kv_cache_usage_perc x\n# TYPE banyan:kv_cache_usage_perc gauge\n"
            "banyan:kv_cache_usage_percent_other 9\n"
            'banyan:kv_cache_usage_perc{model_name="m"} 0.25\n')
    assert parse_kv_usage(text) == 0.25
    assert parse_kv_usage("nothing here") is None
    assert normalize_url("127.0.0.1:1/") == "http://127.0.0.1:1"
    with pytest.raises(ValueError):
        normalize_url("ftp://x")
    with pytest.raises(ValueError):
        RouterArgs(policy="fastest")
    assert RouterArgs(workers=["h:1"]).workers == ["http://h:1"]


# ---- policies ----------------------------------------------------------------------------------


def cache_aware(threshold: float = 0.3, abs_: float = 64, rel: float = 1.5,
                kv_weight: float = 4.0) -> CacheAware:
    return CacheAware(threshold, abs_, rel, kv_weight, max_tree_size=1 << 20,
                      tree=ApproxTree(FakeClock()))


def key(text: str) -> RouteKey:
    return RouteKey("text", text)


def test_cache_aware_sticks_and_spreads() -> None:
    p = cache_aware()
    idle = [Candidate("A"), Candidate("B")]
    first = p.choose(key("system prompt one | q1"), idle)
    assert first.outcome == "cache_miss"
    for q in range(2, 6):
        d = p.choose(key(f"system prompt one | q{q}"), idle)
        assert (d.url, d.outcome) == (first.url, "cache_hit")
        assert d.matched == len("system prompt one | q") and d.key_len == len(key("x" * 22))
    # A new prefix misses and goes to the idle worker with the smaller tree: the other one.
    other = p.choose(key("another system prompt | q1"), idle)
    assert other.outcome == "cache_miss" and other.url != first.url


def test_cache_aware_threshold() -> None:
    p = cache_aware(threshold=0.5)
    idle = [Candidate("A"), Candidate("B")]
    assert p.choose(key("abcdefgh"), idle).url == "A"
    # 4 of 10 symbols match A: not more than half: a miss, to the least loaded (B, smaller tree).
    d = p.choose(key("abcdXXXXXX"), [Candidate("A"), Candidate("B")])
    assert (d.url, d.outcome) == ("B", "cache_miss")
    # 6 of 10 match A: a hit, even though A is busier (below the imbalance thresholds).
    d = p.choose(key("abcdefYYYY"), [Candidate("A", in_flight=5), Candidate("B")])
    assert (d.url, d.outcome) == ("A", "cache_hit")


def test_cache_aware_miss_goes_by_load_not_tree_size() -> None:
    """The hot-spot bug of other routers: misses to the smallest tree regardless of load."""
    p = cache_aware()
    p.tree.insert("x" * 1000, "A")  # A has the bigger tree
    d = p.choose(key("fresh prefix"), [Candidate("A", in_flight=0), Candidate("B", in_flight=3)])
    assert (d.url, d.outcome) == ("A", "cache_miss")
    # KV usage refines the load: A's full cache counts as 4 requests more than B's 3.
    d = p.choose(key("other fresh prefix"), [Candidate("A", in_flight=0, kv_usage=1.0),
                                         Candidate("B", in_flight=3, kv_usage=0.0)])
    assert d.url == "B"
    # Loads within MISS_LOAD_BAND of the lowest count as tied on a miss: the worker holding
    # fewer prefixes takes the new group, though it has two more requests in flight...
    p2 = cache_aware()
    p2.tree.insert("y" * 1000, "B")
    d = p2.choose(key("new group"), [Candidate("A", in_flight=9), Candidate("B", in_flight=7)])
    assert (d.url, d.outcome) == ("A", "cache_miss")
    # ... while loads far apart still decide: 12 vs 4 goes to the idler worker.
    d = p2.choose(key("another group"), [Candidate("A", in_flight=12), Candidate("B", in_flight=4)])
    assert (d.url, d.outcome) == ("B", "cache_miss")


def test_cache_aware_imbalance_falls_back_to_load() -> None:
    p = cache_aware(abs_=2, rel=1.5)
    k = key("the same long prefix for everyone")
    loads = {"A": 0, "B": 0}
    urls = []
    for _ in range(8):  # requests that stay in flight
        d = p.choose(k, [Candidate(u, in_flight=n) for u, n in loads.items()])
        loads[d.url] += 1
        urls.append((d.url, d.outcome))
    # A takes the prefix until it is 3 ahead (3 - 0 > 2 and 3 > 1.5 x 0), then B gets one...
    assert urls[:4] == [("A", "cache_miss"), ("A", "cache_hit"), ("A", "cache_hit"),
                        ("B", "imbalance")]
    # ... and B, now holding the prefix too, shares the rest.
    assert abs(loads["A"] - loads["B"]) <= 3
    # Both thresholds must be passed: a big relative but small absolute spread is balanced.
    p2 = cache_aware(abs_=2, rel=1.5)
    p2.tree.insert(k.text, "A", k.namespace)
    d = p2.choose(k, [Candidate("A", in_flight=2), Candidate("B", in_flight=0)])
    assert (d.url, d.outcome) == ("A", "cache_hit")
    p3 = cache_aware(abs_=2, rel=3.0)  # 10 - 4 > 2 but 10 < 3 x 4
    p3.tree.insert(k.text, "A", k.namespace)
    d = p3.choose(k, [Candidate("A", in_flight=10), Candidate("B", in_flight=4)])
    assert (d.url, d.outcome) == ("A", "cache_hit")


def test_cache_aware_forget_and_no_key() -> None:
    p = cache_aware()
    p.choose(key("abcdef"), [Candidate("A"), Candidate("B", in_flight=1)])
    p.forget("A")
    assert p.tree_sizes() == {}
    d = p.choose(None, [Candidate("A", in_flight=2), Candidate("B", in_flight=1)])
    assert (d.url, d.outcome) == ("B", "cache_miss")
    p.choose(key("zzz"), [Candidate("A")])
    p.flush()
    assert p.tree_sizes() == {}


def test_other_policies() -> None:
    workers = [Candidate("A"), Candidate("B"), Candidate("C")]
    rr = RoundRobin()
    assert [rr.choose(key("k"), workers).url for _ in range(5)] == ["A", "B", "C", "A", "B"]
    sq = ShortestQueue(kv_weight=4.0)
    busy = [Candidate("A", 2, routed=3), Candidate("B", 1, kv_usage=0.5), Candidate("C", 2)]
    assert sq.choose(None, busy).url == "C"  # B: 1 + 4 x 0.5 = 3 > 2; A, C tie: C routed less
    assert least_loaded([Candidate("A", routed=5), Candidate("B", routed=2)], 1.0).url == "B"
    # KV usage differences under LOAD_TIE do not override the tie-breakers; larger ones count.
    noisy = [Candidate("A", kv_usage=0.05, routed=0), Candidate("B", kv_usage=0.0, routed=1)]
    assert least_loaded(noisy, 4.0).url == "A"
    full = [Candidate("A", kv_usage=0.5, routed=0), Candidate("B", kv_usage=0.0, routed=1)]
    assert least_loaded(full, 4.0).url == "B"
    rnd = RandomChoice(seed=0)
    picks = {rnd.choose(None, workers).url for _ in range(50)}
    assert picks == {"A", "B", "C"}
    for name, cls in (("cache_aware", CacheAware), ("round_robin", RoundRobin),
                      ("shortest_queue", ShortestQueue), ("random", RandomChoice)):
        policy = make_policy(RouterArgs(policy=name))
        assert isinstance(policy, cls) and policy.name == name


def test_cache_aware_many_groups_balance() -> None:
    """16 prefix groups x 8 requests, arriving interleaved and staying in flight, on two
    workers: every group sticks to one worker and the groups split evenly."""
    p = cache_aware()
    loads = {"A": 0, "B": 0}
    where: dict[int, set[str]] = {}
    for i, g in zip(range(16 * 8), itertools.cycle(range(16))):
        d = p.choose(key(f"group {g:02d} " + "s" * 200 + f" question {i}"),
                     [Candidate(u, in_flight=n) for u, n in loads.items()])
        loads[d.url] += 1
        where.setdefault(g, set()).add(d.url)
    assert all(len(urls) == 1 for urls in where.values())
    assert loads == {"A": 64, "B": 64}
