"""RadixAttention in the scheduler: reuse is exact, accounted, cache-aware and output-neutral."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from banyan import Engine, SamplingParams
from banyan.batch import ForwardBatch, StepOutput
from banyan.cache.radix import RadixCache
from banyan.mem.allocator import SlotAllocator
from banyan.scheduler import Scheduler, SchedulerConfig
from banyan.scheduler.builder import BudgetConfig
from banyan.scheduler.policy import PolicyConfig
from tests.fake_runner import FakeRunner, reference
from tests.test_scheduler import make_request


def radix_scheduler(num_slots: int = 4000, chunk: int = 256, prefill: int = 256,
                    policy: str = "lpm", page_size: int = 1, max_running: int = 16,
                    in_batch: int = 32) -> tuple[Scheduler, FakeRunner]:
    runner = FakeRunner(num_slots)
    allocator = SlotAllocator(num_slots)
    config = SchedulerConfig(
        max_model_len=2048, budget=BudgetConfig(max_running, prefill, chunk),
        policy=PolicyConfig(policy, 128, in_batch), check_integrity=True,
    )
    return Scheduler(runner, config, allocator, RadixCache(allocator, page_size)), runner


def prompt_tokens_computed(runner: FakeRunner) -> int:
    """Tokens the model computed, less the one decode token per sampled request per step."""
    return sum(sum(b.extend_lens) for b in runner.batches)


def run_collect(sched: Scheduler) -> tuple[dict[str, list[int]], dict[str, int]]:
    outputs: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    while sched.has_work:
        for u in sched.step():
            outputs.setdefault(u.rid, []).extend(u.new_token_ids)
            cached[u.rid] = u.cached_tokens
    return outputs, cached


@pytest.mark.parametrize("page_size", [1, 4])
def test_sequential_requests_reuse_exactly_the_shared_prefix(page_size: int) -> None:
    rng = random.Random(0)
    system = [rng.randrange(3, 97) for _ in range(50)]
    prompts = [system + [rng.randrange(3, 97) for _ in range(rng.randint(1, 20))] for _ in range(5)]
    sched, runner = radix_scheduler(page_size=page_size)
    computed_before = 0
    for i, prompt in enumerate(prompts):
        sched.add_request(make_request(str(i), prompt, 6))
        outputs, cached = run_collect(sched)
        assert outputs[str(i)] == reference(prompt, 6)
        computed = prompt_tokens_computed(runner) - computed_before
        computed_before += computed
        expected_hit = 0 if i == 0 else 50 // page_size * page_size
        assert cached[str(i)] == expected_hit
        # Reported reuse is the real reuse: the model computed exactly the rest
        # (the prompt minus the hit, plus the generated tokens but the last).
        assert computed == len(prompt) - expected_hit + 6 - 1
    assert sched.kv.prefix_hit == sum(50 // page_size * page_size for _ in prompts[1:])


def test_a_finished_request_is_fully_reused_by_its_continuation() -> None:
    """Multi-turn chat: the next turn resends the history; all of it (prompt and answer) hits."""
    sched, _ = radix_scheduler()
    turn1 = list(range(3, 40))
    sched.add_request(make_request("t1", turn1, 10))
    out1, _ = run_collect(sched)
    turn2 = turn1 + out1["t1"] + [50, 51, 52]
    sched.add_request(make_request("t2", turn2, 5))
    out2, cached = run_collect(sched)
    # Everything but the last generated token (never fed to the model) was cached.
    assert cached["t2"] == len(turn1) + len(out1["t1"]) - 1
    assert out2["t2"] == reference(turn2, 5)


def test_in_batch_sharing_defers_the_follower_one_step() -> None:
    shared = list(range(3, 83))  # 80 tokens nobody has computed yet
    sched, runner = radix_scheduler(chunk=512, prefill=512)
    sched.add_request(make_request("first", shared + [90], 4))
    sched.add_request(make_request("second", shared + [91], 4))
    sched.step()
    assert runner.batches[0].extend_lens == [81]  # only the first computes the prefix
    outputs, cached = run_collect(sched)
    assert cached["second"] == 80
    assert outputs["second"] == reference(shared + [91], 4)


def test_a_follower_waits_for_the_last_chunk_of_a_shared_prompt() -> None:
    """The leader's final chunk is scheduled before admission (its KV not cached yet): a
    request sharing that chunk must not compute the same tokens in the same step."""
    shared = list(range(3, 203))  # 200 tokens
    sched, runner = radix_scheduler(chunk=128, prefill=256)
    sched.add_request(make_request("leader", shared + [90], 4))
    sched.step()  # leader: tokens [0, 128), cached after the step
    sched.add_request(make_request("follower", shared + [91], 4))
    sched.step()  # leader: its last 73 tokens; the follower matches only 128 and must wait
    assert runner.batches[1].extend_lens == [73]
    outputs, cached = run_collect(sched)
    assert cached["follower"] == 200
    assert prompt_tokens_computed(runner) == 201 + 1 + 2 * (4 - 1)
    assert outputs["follower"] == reference(shared + [91], 4)


def test_in_batch_sharing_off_computes_the_prefix_twice() -> None:
    shared = list(range(3, 83))
    sched, runner = radix_scheduler(chunk=512, prefill=512, in_batch=10**9)
    sched.add_request(make_request("first", shared + [90], 4))
    sched.add_request(make_request("second", shared + [91], 4))
    sched.step()
    assert runner.batches[0].extend_lens == [81, 81]


@pytest.mark.parametrize("policy,first", [("lpm", "hit"), ("dfs-weight", "hit"), ("fcfs", "miss")])
def test_policy_orders_admission(policy: str, first: str) -> None:
    cached_prefix = list(range(3, 63))
    sched, runner = radix_scheduler(chunk=64, prefill=64, policy=policy)
    sched.add_request(make_request("warm", cached_prefix + [3], 1))
    run_collect(sched)
    runner.batches.clear()
    miss_prompt = list(range(96, 26, -1))  # 70 tokens, nothing cached
    sched.add_request(make_request("miss", miss_prompt, 2))
    sched.add_request(make_request("hit", cached_prefix + [4, 5], 2))
    updates = sched.step()
    # Budget 64: the hit first computes its 2 uncached tokens, then the miss gets a 62-token
    # chunk; the miss first takes the whole budget.
    assert runner.batches[0].extend_lens == ([2, 62] if first == "hit" else [64])
    assert {u.rid for u in updates} == ({"hit"} if first == "hit" else set())


def test_dfs_weight_runs_the_bigger_group_first() -> None:
    sched, runner = radix_scheduler(chunk=8, prefill=8, policy="dfs-weight", max_running=1)
    a, b = list(range(3, 23)), list(range(40, 60))
    sched.add_request(make_request("a", a + [1], 1))
    sched.add_request(make_request("b", b + [1], 1))
    run_collect(sched)
    order: list[str] = []
    for rid, prefix in [("a1", a), ("b1", b), ("b2", b), ("b3", b)]:
        sched.add_request(make_request(rid, prefix + [7, int(rid[1]) + 10], 1))
    while sched.has_work:
        order += [u.rid for u in sched.step() if u.finish_reason is not None]
    assert order[:3] == ["b1", "b2", "b3"] and order[3] == "a1"


def test_namespaces_never_share() -> None:
    sched, _ = radix_scheduler()
    prompt = list(range(3, 50))
    for rid, salt in [("x", "tenant-a"), ("y", "tenant-b"), ("z", "tenant-a")]:
        req = make_request(rid, prompt, 3)
        req.namespace = salt
        sched.add_request(req)
        _, cached = run_collect(sched)
        assert cached[rid] == (0 if rid != "z" else len(prompt) - 1)


def test_memory_pressure_evicts_and_retracts_without_changing_outputs() -> None:
    rng = random.Random(5)
    systems = [[rng.randrange(3, 97) for _ in range(30)] for _ in range(3)]
    prompts = [rng.choice(systems) + [rng.randrange(3, 97) for _ in range(rng.randint(1, 15))]
               for _ in range(24)]
    sched, _ = radix_scheduler(num_slots=160, chunk=16, prefill=32)
    for i, p in enumerate(prompts):
        sched.add_request(make_request(str(i), p, 25))
    outputs = run_all_cached(sched)
    assert sched.total_retractions > 0
    assert sched.kv.cache.stats.evicted_tokens > 0
    for i, p in enumerate(prompts):
        assert outputs[str(i)] == reference(p, 25)


def run_all_cached(sched: Scheduler) -> dict[str, list[int]]:
    outputs, _ = run_collect(sched)
    kv = sched.kv
    assert kv.cache.protected_size == 0
    assert kv.allocator.num_free + kv.cache.evictable_size == kv.capacity
    return outputs


def test_flush_refuses_while_running_and_empties_when_idle() -> None:
    sched, _ = radix_scheduler()
    sched.add_request(make_request("a", list(range(3, 30)), 50))
    sched.step()
    assert sched.kv.cache.flush() is False
    run_collect(sched)
    assert sched.kv.cache.flush() is True
    assert sched.kv.allocator.num_free == sched.kv.capacity


# -- the real model: prefix cache on and off give the same tokens ------------------------------


def sharing_workload(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 512) for _ in range(n)] for n in (120, 45, 200)]
    prompts = []
    for i in range(18):
        base = systems[i % 3]
        prompts.append(base + [rng.randrange(3, 512) for _ in range(rng.randint(1, 30))])
    prompts.append(prompts[0][:60])  # a prompt that is a prefix of another
    prompts.append(list(prompts[1]))  # an exact duplicate
    return prompts


@pytest.mark.parametrize("setting", [
    dict(),
    dict(chunked_prefill_size=40, max_prefill_tokens=64),
    dict(kv_cache_memory=str(600 * 512), chunked_prefill_size=64, max_prefill_tokens=128),
    dict(page_size=4, chunked_prefill_size=48, max_prefill_tokens=96),
    dict(schedule_policy="dfs-weight"),
])
def test_outputs_identical_with_and_without_prefix_cache(llama_dir: Path, setting: dict) -> None:
    prompts = sharing_workload()
    params = [SamplingParams(max_new_tokens=8 + i % 9, temperature=0.0)
              for i in range(len(prompts))]
    results = {}
    for no_cache in (True, False):
        with Engine(str(llama_dir), dtype="float32", device="cpu", disable_tqdm=True,
                    no_prefix_cache=no_cache, **setting) as engine:
            engine.core.scheduler.config.check_integrity = True
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            results[no_cache] = [o.output_ids for o in outs]
            cached = sum(o.cached_tokens for o in outs)
            kv = engine.core.scheduler.kv
            if no_cache:
                assert cached == 0
            else:
                assert cached > 0 and cached == kv.prefix_hit
                if "kv_cache_memory" in setting:
                    assert kv.cache.stats.evicted_tokens > 0
    assert results[False] == results[True]


def test_engine_explains_misses_and_flushes(llama_dir: Path) -> None:
    prompt = list(range(3, 83))
    with Engine(str(llama_dir), dtype="float32", device="cpu", disable_tqdm=True) as engine:
        assert engine.explain_prefix(input_ids=prompt)["miss_cause"] == "unseen"
        engine.generate(input_ids=[prompt], sampling_params=SamplingParams(max_new_tokens=2))
        seen = engine.explain_prefix(input_ids=prompt)
        assert seen["matched"] == len(prompt) and seen["miss_cause"] == "none"
        assert engine.explain_prefix(input_ids=prompt, cache_salt="other")["matched"] == 0
        stats = engine.prefix_cache_stats()
        assert stats["queried_tokens"] == len(prompt) and stats["hit_tokens"] == 0
        [again] = engine.generate(input_ids=[prompt],
                                  sampling_params=SamplingParams(max_new_tokens=2))
        assert again.cached_tokens == len(prompt) - 1
        assert engine.prefix_cache_stats()["hit_tokens"] == len(prompt) - 1
        assert engine.flush_cache() is True
        assert engine.explain_prefix(input_ids=prompt)["matched"] == 0


class FailingRunner(FakeRunner):
    """Raises on its `fail_at`-th run (0-based), before writing any K/V, like a model error."""

    def __init__(self, num_slots: int, fail_at: int) -> None:
        super().__init__(num_slots)
        self.fail_at = fail_at
        self.calls = 0

    def run(self, batch: ForwardBatch) -> StepOutput:
        self.calls += 1
        if self.calls - 1 == self.fail_at:
            raise RuntimeError("injected failure")
        return super().run(batch)


def test_failed_step_tokens_are_not_cached() -> None:
    """A step that fails aborts its requests; the chunks it never computed must not reach the
    prefix cache, or a later request with the same prompt would attend to unwritten K/V."""
    sched, _ = radix_scheduler(chunk=4, prefill=4)
    runner = FailingRunner(4000, fail_at=1)
    sched.runner = runner
    prompt = list(range(3, 15))  # 12 tokens: chunks of 4, the second one fails
    sched.add_request(make_request("a", prompt, 3))
    updates = [u for _ in range(3) for u in sched.step()]
    assert [u.finish_reason for u in updates if u.rid == "a"][-1] == "abort"
    assert len(sched.kv.cache.match_prefix(prompt).slots) == 4  # only the computed chunk
    sched.add_request(make_request("b", prompt, 3))
    outputs, _ = run_collect(sched)
    assert outputs["b"] == reference(prompt, 3)
    sched.kv.check_integrity(sched.running)
