"""The KV tier under the prefix cache (HiCache): block files, and the scheduler and engine using
them. Outputs with the tier must equal outputs without it, whatever was evicted, reloaded,
restarted or corrupted; every slot stays accounted for."""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from banyan import Engine, SamplingParams
from banyan.cache.radix import RadixCache
from banyan.cache.tier.blocks import block_keys, chain_seed
from banyan.cache.tier.file_store import FileStore
from banyan.cache.tier.kv_tier import LoadCostModel
from banyan.mem.allocator import SlotAllocator
from banyan.scheduler import Scheduler, SchedulerConfig
from banyan.scheduler.builder import BudgetConfig
from tests.fake_runner import FakeRunner, reference
from tests.test_scheduler import make_request
from tests.http_client import HTTP

# ---- block keys and the file store ---------------------------------------------------------


def test_block_keys_chain_over_the_whole_prefix() -> None:
    seed = chain_seed("model", None)
    tokens = list(range(40))
    keys = block_keys(seed, tokens, 8)
    assert len(keys) == 5 and len(set(keys)) == 5  # full blocks only (40 // 8)
    assert block_keys(seed, tokens, 8, first=2, count=2) == keys[2:4]
    changed = block_keys(seed, [99] + tokens[1:], 8)
    assert all(a != b for a, b in zip(keys, changed))  # an early token changes every later key
    assert block_keys(chain_seed("model", "tenant"), tokens, 8)[0] != keys[0]
    assert block_keys(chain_seed("other model", None), tokens, 8)[0] != keys[0]
    assert block_keys(chain_seed("model", ""), tokens, 8)[0] != keys[0]


def test_file_store_round_trip_and_restart(tmp_path: Path) -> None:
    store = FileStore(tmp_path, 1 << 20)
    store.put("ab12", [1, 2, 3], b"x" * 100)
    assert store.contains("ab12") and not store.contains("cd34")
    assert bytes(store.get("ab12", [1, 2, 3], 100) or b"") == b"x" * 100
    (tmp_path / "ab" / ".tmp-crashed").write_bytes(b"half a block")
    again = FileStore(tmp_path, 1 << 20)  # a restart finds the block, drops the torn write
    assert again.contains("ab12") and again.stats.files == 1
    assert not (tmp_path / "ab" / ".tmp-crashed").exists()
    assert again.stats.bytes_used == (tmp_path / "ab" / "ab12.kv").stat().st_size


@pytest.mark.parametrize("damage", ["flip a payload byte", "truncate", "other tokens",
                                    "other size", "garbage"])
def test_a_damaged_block_is_never_used(tmp_path: Path, damage: str) -> None:
    store = FileStore(tmp_path, 1 << 20)
    payload = bytes(range(256)) * 4
    store.put("ab12", [5, 6], payload)
    path = tmp_path / "ab" / "ab12.kv"
    data = bytearray(path.read_bytes())
    tokens, size = [5, 6], len(payload)
    if damage == "flip a payload byte":
        data[-7] ^= 0x10
    elif damage == "truncate":
        del data[-1:]
    elif damage == "garbage":
        data = bytearray(b"not a block at all")
    elif damage == "other tokens":
        tokens = [5, 7]
    else:
        size += 2
    path.write_bytes(bytes(data))
    assert store.get("ab12", tokens, size) is None
    assert store.stats.corrupt_files == 1 and not path.exists() and not store.contains("ab12")
    assert store.stats.bytes_used == 0


def test_file_store_keeps_to_its_budget_least_recently_used_first(tmp_path: Path) -> None:
    one = FileStore(tmp_path, 10**9)
    one.put("aa01", [1], b"a" * 1000)
    size = one.stats.bytes_used
    store = FileStore(tmp_path, 3 * size + 10)
    store.put("bb02", [1], b"b" * 1000)
    store.put("cc03", [1], b"c" * 1000)
    assert store.get("aa01", [1], 1000) is not None  # now the most recently used
    store.put("dd04", [1], b"d" * 1000)
    assert not store.contains("bb02") and store.stats.evicted_files == 1
    assert all(store.contains(k) for k in ("aa01", "cc03", "dd04"))
    on_disk = sum(p.stat().st_size for p in tmp_path.rglob("*.kv"))
    assert on_disk == store.stats.bytes_used <= store.budget


# ---- the scheduler with a model-free tier ----------------------------------------------------


class FakeTier:
    """Keeps blocks of the fake runner's KV ((token, position) per slot), keyed by the whole
    token prefix; loads write them back into the runner's store, so a wrong load changes the
    outputs exactly as wrong K/V would."""

    def __init__(self, runner: FakeRunner, block: int) -> None:
        self.runner, self.block = runner, block
        self.blocks: dict[tuple[str | None, tuple[int, ...]], list[tuple[int, int]]] = {}
        self.loaded = 0

    def _key(self, tokens: Sequence[int], ns: str | None, j: int) -> tuple:
        return ns, tuple(tokens[: (j + 1) * self.block])

    def loadable(self, tokens: Sequence[int], namespace: str | None, start: int) -> int:
        j = start // self.block
        while j < len(tokens) // self.block and self._key(tokens, namespace, j) in self.blocks:
            j += 1
        return max(j * self.block - start, 0)

    def load(self, tokens: Sequence[int], namespace: str | None, start: int,
             slots: Sequence[int]) -> int:
        for k, slot in enumerate(slots):
            pos = start + k
            kv = self.blocks[self._key(tokens, namespace, pos // self.block)]
            self.runner.kv[slot] = kv[pos % self.block]
        self.loaded += len(slots)
        return len(slots)

    def save(self, tokens: Sequence[int], namespace: str | None, slots: Sequence[int]) -> None:
        for j in range(len(tokens) // self.block):
            part = slots[j * self.block:(j + 1) * self.block]
            self.blocks[self._key(tokens, namespace, j)] = [self.runner.kv[s] for s in part]

    def observe_compute(self, tokens: int, seconds: float) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
def test_scheduler_with_a_tier_stays_exact_and_leaks_nothing(overlap: bool,
                                                             page_size: int) -> None:
    """1,000 requests on shared prefixes through a pool far smaller than their KV, random
    aborts: every completed output equals the reference, the tier serves many prefixes, and
    the integrity check (free + cached + held = all slots) runs after every step."""
    rng = random.Random(7)
    runner = FakeRunner(600)
    allocator = SlotAllocator(600)
    tier = FakeTier(runner, 8)
    config = SchedulerConfig(max_model_len=1024, budget=BudgetConfig(8, 256, 96),
                             overlap=overlap, check_integrity=True)
    sched = Scheduler(runner, config, allocator, RadixCache(allocator, page_size), tier=tier)
    prefixes = [[rng.randrange(3, 97) for _ in range(rng.randint(40, 160))] for _ in range(12)]
    expected: dict[str, list[int]] = {}
    outputs: dict[str, list[int]] = {}
    aborted: set[str] = set()
    for i in range(1000):
        prompt = rng.choice(prefixes) + [rng.randrange(3, 97) for _ in range(rng.randint(1, 9))]
        rid = str(i)
        expected[rid] = reference(prompt, 4)
        sched.add_request(make_request(rid, prompt, 4))
        if rng.random() < 0.1:
            for u in sched.step():
                outputs.setdefault(u.rid, []).extend(u.new_token_ids)
            victim = rng.choice(list(sched.requests) or [rid])
            if sched.abort(victim) is not None:
                aborted.add(victim)
        if i % 4 == 3:
            while sched.has_work:
                for u in sched.step():
                    outputs.setdefault(u.rid, []).extend(u.new_token_ids)
    while sched.has_work:
        for u in sched.step():
            outputs.setdefault(u.rid, []).extend(u.new_token_ids)
    done = [rid for rid in expected if rid not in aborted]
    assert len(done) > 850
    assert all(outputs[rid] == expected[rid] for rid in done)
    assert tier.loaded > 10_000 and sched.kv.tier_loaded == tier.loaded
    sched.kv.check_integrity([], [])
    assert allocator.num_free + sched.kv.cache.cached_size == allocator.capacity


# ---- the engine with the file tier ------------------------------------------------------------


def _pool_bytes(model: Path, tokens: int = 320) -> int:
    """A float32 KV pool of about `tokens` slots for this model."""
    import torch

    from banyan.mem.kv_pool import kv_bytes_per_slot
    from banyan.models.config import ModelConfig

    cfg = ModelConfig.from_pretrained(model)
    return tokens * kv_bytes_per_slot(cfg.layers, cfg.kv_heads, cfg.head_dim, torch.float32)


def _generate(model: Path, prompts: list[list[int]], **kw: object) -> tuple[list[list[int]], dict]:
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    outs = []
    with Engine(str(model), dtype="float32", device="cpu", disable_tqdm=True,
                kv_cache_memory=str(_pool_bytes(model)), **kw) as engine:
        kv = engine.core.scheduler.kv
        for prompt in prompts:  # one at a time: each evicts the ones before from the pool
            outs.append(engine.generate(input_ids=[prompt], sampling_params=params,
                                        use_tqdm=False)[0].outputs[0].output_ids)
            if kv.tier is not None:
                # Blocks are written in the background and a queued one is not yet held: on
                # a loaded machine the next prompt then recomputed what it would have loaded
                # (1,104 tokens loaded, not 1,500+). Written before the next prompt: the
                # count depends on what the tier holds, not on the writer's pace.
                kv.tier.flush()
        info = {"loaded": kv.tier_loaded, "stats": kv.tier.stats if kv.tier else None,
                "store": kv.tier.store.stats if kv.tier else None, "capacity": kv.capacity}
        if kv.tier is not None:
            kv.tier.flush()
    return outs, info


@pytest.mark.parametrize("arch,page_size", [("llama", 1), ("llama", 4), ("mistral", 1),
                                            ("qwen2", 4), ("qwen3", 1)])
def test_engine_outputs_equal_with_the_file_tier_after_eviction_and_restart(
        model_dirs: dict[str, Path], tmp_path: Path, arch: str, page_size: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Every hit loads: whether loading beats recomputing is the cost model's call, on read and
    # compute rates measured as it runs, and a loaded machine (the whole suite) once measured
    # reads slow enough that half the hits were recomputed (800 tokens loaded, not 1,500+).
    monkeypatch.setattr(LoadCostModel, "worth_loading", lambda self, tokens: True)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(230)] for _ in range(4)]
    prompts = prompts + [p[:200] + [rng.randrange(3, 500) for _ in range(20)] for p in prompts]
    prompts = prompts + prompts  # the second round finds its prefixes only in the tier
    tier = {"hicache_backend": "file", "hicache_dir": str(tmp_path / "tier"),
            "hicache_block_tokens": 16, "page_size": page_size}
    model = model_dirs[arch]
    plain, info = _generate(model, prompts, page_size=page_size)
    assert info["capacity"] < 2 * 230  # the pool holds about one prompt: the rest is evicted
    first, info = _generate(model, prompts, **tier)
    assert first == plain
    assert info["loaded"] > 1500 and info["stats"].saved_blocks > 0
    restarted, info = _generate(model, prompts, **tier)  # the blocks are found on disk
    assert restarted == plain
    assert info["stats"].saved_blocks == 0 and info["loaded"] >= 8 * 13 * 16
    files = sorted((tmp_path / "tier").rglob("*.kv"))
    assert info["store"].bytes_used == sum(f.stat().st_size for f in files)


def test_engine_recomputes_a_corrupted_block(llama_dir: Path, tmp_path: Path) -> None:
    rng = random.Random(4)
    prompt = [rng.randrange(3, 500) for _ in range(300)]
    other = [rng.randrange(3, 500) for _ in range(300)]
    tier = {"hicache_backend": "file", "hicache_dir": str(tmp_path / "tier"),
            "hicache_block_tokens": 16}
    plain, _ = _generate(llama_dir, [prompt])
    _generate(llama_dir, [prompt, other], **tier)
    files = sorted((tmp_path / "tier").rglob("*.kv"), key=os.path.getsize)
    victim = files[len(files) // 2]
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF
    victim.write_bytes(bytes(data))
    outs, info = _generate(llama_dir, [prompt, other, prompt], **tier)
    assert outs[0] == outs[2] == plain[0]
    assert info["store"].corrupt_files == 1
    # deleted, then written again whole when the recomputed prompt finished
    assert victim.exists() and victim.read_bytes() != bytes(data)


def test_recomputing_is_chosen_when_it_is_estimated_faster(tmp_path: Path) -> None:
    """The load-or-recompute estimate: measured rates decide; a tier hit that would load
    slower than the prompt computes is left unused (and counted)."""
    import torch

    from banyan.cache.tier.kv_tier import KVTier, LoadCostModel
    from banyan.mem.kv_pool import KVPool

    costs = LoadCostModel(bytes_per_token=1000, read_rate=1e9)
    assert costs.worth_loading(64)  # nothing computed yet: loading is taken to win
    costs.observe_compute(2000, 1.0)  # 2,000 tokens/s: 64 tokens take 32 ms
    assert costs.worth_loading(64)  # 1 ms + 64 us to load
    for _ in range(40):  # the tier turns out to read 1 MB/s: 64 tokens would take 65 ms
        costs.observe_load(10**6, 1.0)
    assert costs.read_rate < 1.1e6 and not costs.worth_loading(64)
    pool = KVPool(1, 64, 1, 4, torch.float32, "cpu")
    tier = KVTier(pool, FileStore(tmp_path, 1 << 20), 4, "model")
    tokens = list(range(3, 20))
    tier.save(tokens, None, list(range(1, 18)))
    tier.flush()
    assert tier.held(tokens, None, 0) == 16 and tier.loadable(tokens, None, 0) == 16
    tier.costs.compute_rate = 1e12  # a device that computes faster than any disk reads
    assert tier.loadable(tokens, None, 0) == 0 and tier.stats.recompute_preferred == 1
    tier.close()


def test_tier_flags_are_checked() -> None:
    from banyan.args import EngineArgs

    with pytest.raises(ValueError, match="hicache_block_tokens"):
        EngineArgs(hicache_backend="file", page_size=4, hicache_block_tokens=10)
    with pytest.raises(ValueError, match="prefix cache"):
        EngineArgs(hicache_backend="file", no_prefix_cache=True)
    with pytest.raises(ValueError, match="hicache_size"):
        EngineArgs(hicache_backend="file", hicache_size="lots")


def test_server_reports_the_tier(llama_dir: Path, tmp_path: Path) -> None:
    """`banyan serve --hicache-backend file`: a prompt evicted from the pool is loaded back
    (same text) and the counters reach /metrics and /server_info. (Restarts: the engine test
    above; a server builds its engine the same way.) The pool is int8 (codes and scales go to
    the tier as they are): 50 KiB hold the 320 tokens 160 KiB of float32 would."""
    from tests.server_helpers import metric_values, running_server, wait_idle_and_free

    rng = random.Random(5)
    prompt = [rng.randrange(3, 500) for _ in range(240)]
    other = [rng.randrange(3, 500) for _ in range(240)]
    flags = ("--hicache-backend", "file", "--hicache-dir", str(tmp_path / "tier"),
             "--hicache-block-tokens", "16", "--kv-cache-memory", "50KiB",
             "--kv-cache-dtype", "int8")

    def complete(url: str, ids: list[int]) -> str:
        reply = HTTP.post(f"{url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": ids, "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True})
        reply.raise_for_status()
        return reply.json()["choices"][0]["text"]

    with running_server(llama_dir, tmp_path, *flags) as srv:
        first = complete(srv.url, prompt)
        complete(srv.url, other)  # evicts `prompt` from the pool
        assert complete(srv.url, prompt) == first
        loaded = metric_values(srv.url)[("banyan:hicache_loaded_tokens_total", ())]
        assert loaded >= 224
        info = wait_idle_and_free(srv.url)
        assert info["hicache"]["loaded_tokens"] == loaded and info["hicache"]["files"] >= 28
        assert info["kv_cache_dtype"] == "int8" and info["kv_bytes_per_token"] == 160
        assert info["kv_capacity"] == 50 * 1024 // 160 - 1  # the padding slot aside


def test_explain_prefix_names_the_tier(llama_dir: Path, tmp_path: Path) -> None:
    rng = random.Random(6)
    prompt = [rng.randrange(3, 500) for _ in range(240)]
    other = [rng.randrange(3, 500) for _ in range(240)]
    params = SamplingParams(max_new_tokens=2, temperature=0.0)
    with Engine(str(llama_dir), dtype="float32", device="cpu", disable_tqdm=True,
                kv_cache_memory="160KiB", hicache_backend="file",
                hicache_dir=str(tmp_path / "tier"), hicache_block_tokens=16) as engine:
        for ids in (prompt, other):
            engine.generate(input_ids=[ids], sampling_params=params, use_tqdm=False)
        engine.core.scheduler.kv.tier.flush()
        why = engine.explain_prefix(input_ids=prompt)
        assert why["miss_cause"] == "in_tier" and why["matched"] + why["tier_tokens"] == 240
        assert engine.explain_prefix(input_ids=prompt, cache_salt="t")["tier_tokens"] == 0


def test_model_identity_ignores_a_tied_head_made_at_load(llama_dir: Path) -> None:
    """Whether a run builds a tied head copy depends on the linear method picked at load (timed
    on the CPU): the blocks' keys must not."""
    import torch

    from banyan.cache.tier.kv_tier import model_identity
    from banyan.layers.linear import Linear
    from banyan.models.loader import load_model

    model = load_model(llama_dir, dtype="float32", device=torch.device("cpu"),
                       show_progress=False)
    before = model_identity(model, torch.float32)
    model.tied_head = Linear.from_weight(model.embed_tokens.weight)
    assert model_identity(model, torch.float32) == before
    assert model_identity(model, torch.bfloat16) != before
