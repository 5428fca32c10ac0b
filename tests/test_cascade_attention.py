"""Cascade (shared-prefix) attention: decodes and extends against a naive per-request softmax
attention (one group, several, mixed with plain decodes and extends; MHA, GQA, MQA; float32 and
bf16), the grouping and threshold rules, and greedy output end to end against transformers with
the cascade forced on and with the default policy."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from banyan import Engine, SamplingParams
from banyan.attention.prefix_groups import CascadePolicy, find_shared_prefixes
from banyan.attention.cpu_native import CpuNativeBackend
from banyan.attention.native_plan import MAX_NATIVE_EXTEND
from banyan.attention.torch_backend import SdpaBackend, TorchAttentionMetadata
from banyan.batch import ForwardBatch
from banyan.mem.kv_pool import KVPool
from banyan.mem.req_table import ReqToTokenTable
from tests.hf_reference import hf_greedy
from tests.test_attention import naive

# cascade whenever two rows share a slot
ALWAYS = CascadePolicy(min_prefix=1, min_saved=1, max_extend=256, extend_prefix_ratio=0)


@dataclass
class Req:
    slots: list[int]  # the row's slots, positions [0, prefix + extend)
    extend: int = 1  # new tokens this step (1: a decode)


class Scene:
    """A pool filled with random K/V, a table, and a step over the given requests."""

    def __init__(
        self, reqs: list[Req], heads: int, kv_heads: int, dim: int = 8, layers: int = 2,
        dtype: torch.dtype = torch.float32, seed: int = 0,
        stale: dict[int, list[int]] | None = None, device: str = "cpu",
        kv_cache_dtype: str = "auto",
    ) -> None:
        """stale: request index -> slots written right after its row's end (a reused row)."""
        g = torch.Generator().manual_seed(seed)
        live = max(s for r in reqs for s in r.slots) + 1
        self.pool = KVPool.named(layers, live + 16, kv_heads, dim, dtype, device,
                                 kv_cache_dtype)
        every = torch.arange(self.pool.num_slots, device=device)
        for layer in range(layers):
            shape = (self.pool.num_slots, kv_heads, dim)
            k, v = (torch.randn(shape, generator=g) for _ in range(2))
            if self.pool.quantized:  # rows of unequal magnitudes, so per-row scales matter
                k, v = (x * (0.25 + torch.rand(shape[:2] + (1,), generator=g) * 1.75)
                        for x in (k, v))
            self.pool.store(layer, every, k.to(dtype).to(device), v.to(dtype).to(device))
        longest = max(len(r.slots) for r in reqs)
        self.table = ReqToTokenTable(len(reqs) + 3, longest + 5, device)
        # Stale entries past every row's end, as a reused row holds: slots no live row has.
        table = torch.randint(live, live + 16, self.table.table.shape, generator=g)
        rows = random.Random(seed).sample(range(len(reqs) + 3), len(reqs))
        for i, (row, r) in enumerate(zip(rows, reqs, strict=True)):
            slots = r.slots + (stale or {}).get(i, [])
            table[row, : len(slots)] = torch.tensor(slots)
        self.table.table.copy_(table)
        self.reqs, self.heads, self.layers, self.gen = reqs, heads, layers, g
        prefix_lens = [len(r.slots) - r.extend for r in reqs]
        out_slots = [s for r, p in zip(reqs, prefix_lens, strict=True) for s in r.slots[p:]]
        self.batch = ForwardBatch(
            rows=rows, prefix_lens=prefix_lens, extend_lens=[r.extend for r in reqs],
            input_ids=[0] * len(out_slots), out_slots=out_slots,
        )
        self.out_slots = torch.tensor(out_slots, dtype=torch.int64, device=device)

    def check(self, backend: SdpaBackend, atol: float = 1e-5) -> TorchAttentionMetadata:
        """Run every layer through `backend` and compare each request with `naive`."""
        meta = backend.plan(self.batch, self.out_slots)
        dim, dtype = self.pool.head_dim, self.pool.dtype
        for layer in range(self.layers):
            q = torch.randn(len(self.out_slots), self.heads, dim, generator=self.gen).to(dtype)
            # The new tokens' K/V are already in the pool: storing them again changes nothing
            # (a quantized row's dequantized values quantize to the same codes).
            pool_k, pool_v = self.values(layer)
            k = pool_k[self.out_slots.cpu()].to(dtype).to(self.out_slots.device)
            v = pool_v[self.out_slots.cpu()].to(dtype).to(self.out_slots.device)
            out = backend.forward(q.to(k.device), k, v, layer, meta).cpu()
            pool_k, pool_v = self.values(layer)  # (bf16 inputs may requantize a code by one)
            start = 0
            for r, p in zip(self.reqs, self.batch.prefix_lens, strict=True):
                idx = torch.tensor(r.slots)
                want = naive(
                    q[start : start + r.extend].double(), pool_k[idx].double(),
                    pool_v[idx].double(), p,
                )
                got = out[start : start + r.extend].double()
                torch.testing.assert_close(got, want, atol=atol, rtol=atol)
                start += r.extend
        return meta


    def values(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool's K, V of a layer as attention must see them: float64 on the CPU (codes
        times scales when quantized)."""
        lk = self.pool.layer(layer)
        if lk.k_scale is None:
            return lk.k.cpu().double(), lk.v.cpu().double()
        assert lk.v_scale is not None
        return tuple(c.cpu().double() * s.cpu().double().unsqueeze(-1)  # type: ignore[return-value]
                     for c, s in ((lk.k, lk.k_scale), (lk.v, lk.v_scale)))


def fresh(counter: list[int], n: int) -> list[int]:
    """n slots never used before."""
    out = list(range(counter[0], counter[0] + n))
    counter[0] += n
    return out


HEADS = [(4, 4), (6, 2), (6, 1)]  # MHA, GQA, MQA


def groups_of(meta: TorchAttentionMetadata, extends: bool = False) -> list[tuple[int, int]]:
    """(members, prefix length) of each decode (or extend) cascade group, in plan order."""
    plan = meta.ext_cascade if extends else meta.cascade
    return [] if plan is None else [(g.count, g.length) for g in plan.groups]


@pytest.mark.parametrize("heads,kv_heads", HEADS)
def test_one_group(heads: int, kv_heads: int) -> None:
    c = [1]
    prefix = fresh(c, 40)
    own_lens = [1, 5, 17, 2, 9]  # 1: the context is the prefix + the new token
    reqs = [Req(prefix + fresh(c, n)) for n in own_lens]
    scene = Scene(reqs, heads, kv_heads)
    meta = scene.check(SdpaBackend(scene.pool, scene.table, cascade=ALWAYS))
    assert groups_of(meta) == [(5, 40)] and meta.dec_count == 0


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_pool_through_the_cascade(kv_cache_dtype: str, dtype: torch.dtype) -> None:
    """The cascade's gathers dequantize a quantized pool's rows (codes x scales)."""
    c = [1]
    prefix = fresh(c, 40)
    reqs = [Req(prefix + fresh(c, n)) for n in (1, 5, 17)] + [Req(fresh(c, 12))]
    scene = Scene(reqs, 6, 2, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    meta = scene.check(SdpaBackend(scene.pool, scene.table, cascade=ALWAYS),
                       atol=5e-5 if dtype == torch.float32 else 4e-2)
    assert groups_of(meta) == [(3, 40)] and meta.dec_count == 1


@pytest.mark.parametrize("heads,kv_heads", HEADS)
def test_a_row_that_is_a_prefix_of_the_others_caps_p(heads: int, kv_heads: int) -> None:
    c = [1]
    prefix = fresh(c, 30)
    # The first request's whole context is the others' first 30 slots: P stops at 29 so it
    # keeps its new token (slot 30 of the others) in its own part.
    reqs = [Req(list(prefix))] + [Req(prefix + fresh(c, n)) for n in (3, 8)]
    scene = Scene(reqs, heads, kv_heads)
    meta = scene.check(SdpaBackend(scene.pool, scene.table, cascade=ALWAYS))
    assert groups_of(meta) == [(3, 29)]


@pytest.mark.parametrize("heads,kv_heads", HEADS)
def test_groups_with_different_prefixes_and_ungrouped_decodes(heads: int, kv_heads: int) -> None:
    c = [1]
    sys_a, sys_b, sys_c = fresh(c, 33), fresh(c, 50), fresh(c, 70)
    reqs = (
        [Req(sys_a + fresh(c, n)) for n in (4, 1, 12)]
        + [Req(fresh(c, 90))]  # alone, longer than every grouped row
        + [Req(sys_b + fresh(c, n)) for n in (2, 30)]
        + [Req(fresh(c, 3))]
        + [Req(sys_c + fresh(c, n)) for n in (7, 7, 1, 20)]
    )
    random.Random(1).shuffle(reqs)  # group members scattered over the batch
    scene = Scene(reqs, heads, kv_heads)
    meta = scene.check(SdpaBackend(scene.pool, scene.table, cascade=ALWAYS))
    assert sorted(groups_of(meta)) == [(2, 50), (3, 33), (4, 70)]
    assert meta.dec_count == 2  # the two loners on the plain path


@pytest.mark.parametrize("heads,kv_heads", HEADS)
def test_mixed_decode_and_extend_step(heads: int, kv_heads: int) -> None:
    c = [1]
    shared = fresh(c, 48)
    reqs = [
        Req(shared + fresh(c, 6)),
        Req(fresh(c, 9), extend=9),  # a first chunk: no cached prefix
        Req(shared + fresh(c, 3)),
        Req(shared + fresh(c, 12), extend=5),  # an extend over the shared prefix
        Req(fresh(c, 25)),  # an ungrouped decode
        Req(shared + fresh(c, 1)),
        Req(shared[:20] + fresh(c, 7), extend=7),
    ]
    scene = Scene(reqs, heads, kv_heads)
    meta = scene.check(SdpaBackend(scene.pool, scene.table, cascade=ALWAYS))
    assert groups_of(meta) == [(3, 48)] and meta.dec_count == 1
    # the two extends over a cached prefix share its first 20 slots
    assert groups_of(meta, extends=True) == [(2, 20)] and len(meta.extends) == 1


@pytest.mark.parametrize("heads,kv_heads", HEADS)
def test_extends_over_a_shared_prefix(heads: int, kv_heads: int) -> None:
    c = [1]
    sys_a, sys_b = fresh(c, 64), fresh(c, 37)
    # (own cached tokens past the shared prefix, new tokens)
    shapes_a = [(0, 8), (5, 3), (0, 2), (12, 8), (1, 5)]
    reqs = [Req(sys_a + fresh(c, o + n), extend=n) for o, n in shapes_a]
    reqs += [Req(sys_b + fresh(c, o + n), extend=n) for o, n in [(3, 4), (0, 6)]]
    reqs += [Req(fresh(c, 30), extend=6), Req(fresh(c, 9), extend=9)]  # nothing shared
    reqs += [Req(sys_a + fresh(c, 4)), Req(sys_a + fresh(c, 9))]  # decodes
    reqs += [Req(sys_a + fresh(c, 300), extend=300)]  # too long for the extend cascade
    random.Random(2).shuffle(reqs)
    scene = Scene(reqs, heads, kv_heads)
    meta = scene.check(SdpaBackend(scene.pool, scene.table, cascade=ALWAYS))
    assert sorted(groups_of(meta, extends=True)) == [(2, 37), (5, 64)]
    assert groups_of(meta) == [(2, 64)]
    assert len(meta.extends) == 3


def test_extend_thresholds() -> None:
    c = [1]
    prefix = fresh(c, 320)
    policy = CascadePolicy(min_prefix=1, min_saved=1)  # default max_extend and prefix ratio
    # own parts of 20 = 320 / 16: just within the ratio
    reqs = [Req(prefix + fresh(c, 20), extend=n) for n in (20, 20, 8)]
    scene = Scene(reqs, 4, 2)
    meta = scene.check(SdpaBackend(scene.pool, scene.table, cascade=policy))
    assert groups_of(meta, extends=True) == [(3, 320)]
    # an own part of 21 is past it: that request alone takes the plain path
    scene = Scene(reqs + [Req(prefix + fresh(c, 21), extend=2)], 4, 2)
    meta = scene.check(SdpaBackend(scene.pool, scene.table, cascade=policy))
    assert groups_of(meta, extends=True) == [(3, 320)] and len(meta.extends) == 1
    # an extend of 33 > max_extend tokens is not a candidate; the others still group
    scene = Scene(reqs + [Req(prefix[:300] + fresh(c, 33), extend=33)], 4, 2)
    meta = scene.check(SdpaBackend(scene.pool, scene.table, cascade=policy))
    assert groups_of(meta, extends=True) == [(3, 320)] and len(meta.extends) == 1


def test_an_own_block_past_the_bound_runs_the_plain_way() -> None:
    c = [1]
    prefix = fresh(c, 40)
    reqs = [Req(prefix + fresh(c, 10), extend=10) for _ in range(3)]
    scene = Scene(reqs, 4, 2)
    # 3 rows x 10 queries x 10 own keys = 300
    fits = CascadePolicy(1, 1, max_extend=256, extend_prefix_ratio=0, max_own_block=300)
    meta = scene.check(SdpaBackend(scene.pool, scene.table, cascade=fits))
    assert groups_of(meta, extends=True) == [(3, 40)]
    over = CascadePolicy(1, 1, max_extend=256, extend_prefix_ratio=0, max_own_block=299)
    meta = scene.check(SdpaBackend(scene.pool, scene.table, cascade=over))
    assert meta.ext_cascade is None and len(meta.extends) == 3


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda(dtype: torch.dtype) -> None:
    c = [1]
    sys_a, sys_b = fresh(c, 64), fresh(c, 37)
    reqs = [Req(sys_a + fresh(c, n)) for n in (1, 4, 9)]
    reqs += [Req(sys_b + fresh(c, n)) for n in (2, 6)] + [Req(fresh(c, 20))]
    reqs += [Req(sys_a + fresh(c, o + n), extend=n) for o, n in [(0, 8), (5, 3), (2, 2)]]
    scene = Scene(reqs, 6, 2, dim=64, dtype=dtype, device="cuda")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    meta = scene.check(SdpaBackend(scene.pool, scene.table, cascade=ALWAYS), atol=tol)
    assert sorted(groups_of(meta)) == [(2, 37), (3, 64)]
    assert groups_of(meta, extends=True) == [(3, 64)]


def test_bfloat16_cascade_is_as_accurate_as_plain() -> None:
    c = [1]
    prefix = fresh(c, 200)
    reqs = [Req(prefix + fresh(c, n)) for n in (1, 9, 33, 64, 5, 17, 40, 2)]
    scene = Scene(reqs, 6, 2, dim=16, dtype=torch.bfloat16)
    # Against the exact float64 attention of the stored bf16 K/V: within bf16 rounding...
    meta = scene.check(SdpaBackend(scene.pool, scene.table, cascade=ALWAYS), atol=2e-2)
    assert groups_of(meta) == [(8, 200)]
    # ... and no further from it than the plain SDPA path on the same queries.
    q = (3 * torch.randn(len(reqs), 6, 16, generator=torch.Generator().manual_seed(5))).bfloat16()
    k, v = scene.pool.k[0][scene.out_slots].clone(), scene.pool.v[0][scene.out_slots].clone()
    errors = []
    for policy in (ALWAYS, None):
        backend = SdpaBackend(scene.pool, scene.table, cascade=policy)
        out = backend.forward(q, k, v, 0, backend.plan(scene.batch, scene.out_slots)).double()
        want = torch.cat([
            naive(q[i : i + 1].double(), scene.pool.k[0][r.slots].double(),
                  scene.pool.v[0][r.slots].double(), len(r.slots) - 1)
            for i, r in enumerate(reqs)
        ])
        errors.append((out - want).abs().mean().item())
    assert errors[0] <= errors[1]


def test_threshold_decides_the_path() -> None:
    c = [1]
    prefix = fresh(c, 64)
    reqs = [Req(prefix + fresh(c, n)) for n in (3, 5, 2, 8)]
    scene = Scene(reqs, 4, 2)
    # 3 extra members x 64 = 192 prefix rows saved per layer
    on = CascadePolicy(min_prefix=64, min_saved=192)
    meta = scene.check(SdpaBackend(scene.pool, scene.table, cascade=on))
    assert groups_of(meta) == [(4, 64)]
    for off in (CascadePolicy(min_prefix=65, min_saved=1), CascadePolicy(1, min_saved=193), None):
        meta = scene.check(SdpaBackend(scene.pool, scene.table, cascade=off))
        assert meta.cascade is None and meta.dec_count == 4
    # The default policy: worth it for 64 requests sharing 1,024 tokens, not for 4 sharing 64.
    assert scene.check(SdpaBackend(scene.pool, scene.table)).cascade is None
    shared = list(range(1, 1025))
    big = Scene([Req(shared + fresh([2000 + 100 * i], 30)) for i in range(64)], 4, 2)
    meta = big.check(SdpaBackend(big.pool, big.table))
    assert groups_of(meta) == [(64, 1024)]


def test_an_odd_member_does_not_shrink_the_group() -> None:
    c = [1]
    prefix = fresh(c, 100)
    odd = prefix[:40] + fresh(c, 70)  # shares only 40 with the others
    rows = [odd] + [prefix + fresh(c, 5) for _ in range(5)]
    table = torch.zeros((6, 120), dtype=torch.int32)
    for i, r in enumerate(rows):
        table[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
    lens = [len(r) for r in rows]
    # The odd row is the bucket's leader, yet the five others keep their 100: 4 x 100 > 5 x 40.
    [group] = find_shared_prefixes(table, list(range(6)), lens, CascadePolicy(32, 1))
    assert group.members == [1, 2, 3, 4, 5] and group.length == 100


@pytest.mark.parametrize("heads,kv_heads", HEADS)
def test_a_leader_matching_through_stale_entries(heads: int, kv_heads: int) -> None:
    c = [1]
    prefix = fresh(c, 100)
    # The first row (the bucket's leader) holds only prefix[:60]; past its end it still holds
    # prefix[60:] from a previous request. The others match it through those stale entries,
    # so they must share the 100 among themselves, and the leader keeps its own 59.
    reqs = [Req(prefix[:60])] + [Req(prefix + fresh(c, n)) for n in (2, 6, 1, 9)]
    scene = Scene(reqs, heads, kv_heads, stale={0: prefix[60:]})
    meta = scene.check(SdpaBackend(scene.pool, scene.table, cascade=ALWAYS))
    assert groups_of(meta) == [(4, 100)] and meta.dec_count == 1


def test_prompts_sharing_only_a_template_opening_are_separate_groups() -> None:
    c = [1]
    opening = fresh(c, 10)  # e.g. "<|im_start|>system\n", shared by every chat
    sys_a, sys_b = opening + fresh(c, 60), opening + fresh(c, 80)
    rows = [sys_a + fresh(c, 3), sys_b + fresh(c, 4), sys_a + fresh(c, 5), sys_b + fresh(c, 1)]
    table = torch.zeros((4, 100), dtype=torch.int32)
    for i, r in enumerate(rows):
        table[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
    groups = find_shared_prefixes(table, [0, 1, 2, 3], [len(r) for r in rows], CascadePolicy(32, 1))
    assert sorted((g.members, g.length) for g in groups) == [([0, 2], 70), ([1, 3], 90)]


# ------------------------------------------------------------------ end to end


def shared_prompts(systems: list[int], count: int, seed: int = 0) -> list[list[int]]:
    """count prompts over len(systems) system prompts of those lengths, and one prompt that is
    exactly a system prompt."""
    rng = random.Random(seed)
    heads = [[rng.randrange(3, 512) for _ in range(n)] for n in systems]
    prompts = [heads[i % len(heads)] + [rng.randrange(3, 512) for _ in range(rng.randint(1, 25))]
               for i in range(count)]
    prompts.append(list(heads[0]))
    return prompts


FORCED = CascadePolicy(min_prefix=8, min_saved=1, max_extend=256, extend_prefix_ratio=0)
CASES = {
    # the cascade forced on for any sharing (decode and extend groups, several prefixes)
    "llama-forced": ("llama", FORCED, [150, 90, 40], 14),
    "mistral-forced": ("mistral", FORCED, [150, 90, 40], 14),
    "qwen3-forced": ("qwen3", FORCED, [150, 90, 40], 14),
    # the default policy, on enough sharing to pass its thresholds
    "llama-default": ("llama", CascadePolicy(), [150], 40),
}


def greedy_plans_match_transformers(
    path: Path, monkeypatch: pytest.MonkeyPatch, systems: list[int], count: int, **backend: object
) -> list[TorchAttentionMetadata]:
    """Greedy outputs over shared system prompts equal transformers', with the engine's backend
    built with `backend` keywords -> every step's attention plan."""
    plans: list[TorchAttentionMetadata] = []

    native = bool(backend.pop("native", False))
    if native:  # the row kernel's extends too, where the engine gives them to the prefill one
        backend.setdefault("max_extend", MAX_NATIVE_EXTEND)

    class Recording(CpuNativeBackend if native else SdpaBackend):  # type: ignore[misc]
        def plan(self, batch: ForwardBatch, out_slots: torch.Tensor) -> TorchAttentionMetadata:
            meta = super().plan(batch, out_slots)
            plans.append(meta)
            return meta

    monkeypatch.setattr(
        "banyan.runner.model_runner.create_backend",
        lambda name, pool, table: Recording(pool, table, **backend),
    )
    prompts = shared_prompts(systems, count)
    max_new = [6 + i % 7 for i in range(len(prompts))]
    with Engine(str(path), dtype="float32", device="cpu", disable_tqdm=True, max_prefill_tokens=256,
                chunked_prefill_size=128) as engine:
        outs = engine.generate(
            input_ids=prompts,
            sampling_params=[SamplingParams(max_new_tokens=n, temperature=0.0) for n in max_new],
        )
    for i, (out, p, n) in enumerate(zip(outs, prompts, max_new, strict=True)):
        assert out.output_ids == hf_greedy(path, p, n), f"prompt {i}"
    return plans


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers_with_the_cascade(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    arch, policy, systems, count = CASES[case]
    plans = greedy_plans_match_transformers(
        model_dirs[arch], monkeypatch, systems, count, cascade=policy, native=False
    )
    cascaded = [m.cascade for m in plans if m.cascade is not None]
    assert len(cascaded) >= 3
    if len(systems) > 1:
        assert max(len(c.groups) for c in cascaded) >= 2
        assert any(m.ext_cascade is not None for m in plans)
