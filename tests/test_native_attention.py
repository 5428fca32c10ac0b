"""The native CPU attention kernel (banyan/kernels): decodes read in place from the pool, alone and
grouped by shared prefix, and causal extends over a cached prefix, against a naive float64
softmax attention (MHA, GQA, MQA; head dims on the AVX-512 path and off it; float32 and bf16;
contexts of 1 token and not a multiple of the kernel's block; decodes mixed with extends in one
step), and greedy output end to end against transformers with the kernel taking every decode
and every chunk over a cached prefix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from banyan.attention.cpu_native import CpuNativeBackend, NativeMetadata
from banyan.attention.native_plan import MAX_NATIVE_EXTEND, native_attention
from banyan.kernels import attention_kernels, native
from tests.test_cascade_attention import Req, Scene, fresh, greedy_plans_match_transformers

pytestmark = pytest.mark.skipif(
    native.load() is None, reason="native CPU kernels unavailable (no C++ compiler?)"
)

HEADS = [(4, 4), (6, 2), (6, 1)]  # MHA, GQA, MQA


def native_backend(scene: Scene) -> CpuNativeBackend:
    assert CpuNativeBackend.supports(scene.pool)
    # every extend the kernel can take, on any CPU: its portable loops are checked too
    # (prefill_kernel: no start-up probe, which on AMX may send fresh chunks to SDPA)
    return CpuNativeBackend(scene.pool, scene.table, max_extend=MAX_NATIVE_EXTEND,
                            prefill_kernel=True)


def groups_of(meta: NativeMetadata) -> list[tuple[int, int]]:
    """(members, shared prefix) of each native decode group, 0-prefix singletons left out."""
    plan = meta.native
    assert plan is not None
    starts, prefixes = plan.group_start.tolist(), plan.group_prefix.tolist()
    return [(starts[g + 1] - starts[g], p) for g, p in enumerate(prefixes) if p > 0]


@pytest.mark.parametrize("heads,kv_heads", HEADS)
@pytest.mark.parametrize("dim", [64, 24])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_decodes_match_naive(
    heads: int, kv_heads: int, dim: int, dtype: torch.dtype
) -> None:
    c = [1]
    # lengths around the 16-key block: 1, 15, 16, 17, 40, and one long context
    reqs = [Req(fresh(c, n)) for n in (1, 15, 16, 17, 40, 300)]
    scene = Scene(reqs, heads, kv_heads, dim=dim, dtype=dtype)
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    meta = scene.check(native_backend(scene), atol=atol)
    assert groups_of(meta) == []


@pytest.mark.parametrize("heads,kv_heads", HEADS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("own", [33, 600])  # 600: a member's own keys in several parts
def test_grouped_decodes_match_naive(heads: int, kv_heads: int, dtype: torch.dtype,
                                     own: int) -> None:
    c = [1]
    system_a, system_b = fresh(c, 100), fresh(c, 37)
    reqs = [
        Req(system_a + fresh(c, 5)),
        Req(system_b + fresh(c, 20)),
        Req(system_a + fresh(c, 1)),
        Req(fresh(c, 50)),
        Req(system_a + fresh(c, own)),
        Req(system_b + fresh(c, 2)),
    ]
    scene = Scene(reqs, heads, kv_heads, dim=64, dtype=dtype)
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    meta = scene.check(native_backend(scene), atol=atol)
    assert sorted(groups_of(meta)) == [(2, 37), (3, 100)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_group_bigger_than_a_work_slice(dtype: torch.dtype) -> None:
    """40 members over one prefix: the kernel splits them into slices of 16 (48 query rows)
    per KV head, each re-reading the prefix; every member still sees all of it."""
    c = [1]
    system = fresh(c, 70)
    reqs = [Req(system + fresh(c, 1 + i % 9)) for i in range(40)]
    scene = Scene(reqs, 6, 2, dim=64, dtype=dtype)
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    meta = scene.check(native_backend(scene), atol=atol)
    assert groups_of(meta) == [(40, 70)]


@pytest.mark.parametrize("dim", [64, 96, 128])
def test_a_big_group_of_decodes_over_a_short_shared_prefix(dim: int) -> None:
    """bf16, 8 members x 3 query heads over 150 shared keys (less than a part of the kernel's:
    each member attends them as its own keys, the group's prefix taken down to whole parts)."""
    c = [1]
    system = fresh(c, 150)
    reqs = [Req(system + fresh(c, 1 + 9 * i)) for i in range(8)] + [Req(fresh(c, 90))]
    scene = Scene(reqs, 9, 3, dim=dim, dtype=torch.bfloat16)
    meta = scene.check(native_backend(scene), atol=2e-2)
    assert groups_of(meta) == [(8, 150)]


def test_decodes_mixed_with_extends_and_stale_rows() -> None:
    c = [1]
    system = fresh(c, 64)
    reqs = [
        Req(system + fresh(c, 3)),
        Req(fresh(c, 30), extend=7),  # an extend between the decodes
        Req(system + fresh(c, 9)),
        Req(system + fresh(c, 12), extend=4),
    ]
    # a reused row: stale slots right after its end must never be read
    scene = Scene(reqs, 6, 2, dim=64, stale={0: fresh(c, 4), 2: fresh(c, 4)})
    meta = scene.check(native_backend(scene))
    assert groups_of(meta) == [(2, 64)]
    assert meta.native is not None and sorted(meta.native.n_new.tolist()) == [1, 1, 4, 7]
    assert meta.native.num_tokens == len(scene.out_slots)  # the kernel took the whole step


@pytest.mark.parametrize("heads,kv_heads", HEADS)
@pytest.mark.parametrize("dim", [64, 24])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extends_match_naive(
    heads: int, kv_heads: int, dim: int, dtype: torch.dtype
) -> None:
    """Prefill chunks attend causally in the kernel, over cached tokens or none (lengths around
    the 16-key block); chunks past MAX_NATIVE_EXTEND go to the prefill kernel."""
    c = [1]
    reqs = [
        Req(fresh(c, 5 + 2), extend=2),
        Req(fresh(c, 40 + 16), extend=16),
        Req(fresh(c, 100 + 17), extend=17),
        Req(fresh(c, 1 + 33), extend=33),
        Req(fresh(c, 3 + 300), extend=300),  # too long: the prefill kernel
        Req(fresh(c, 20), extend=20),  # nothing cached: the kernel too
        Req(fresh(c, 260), extend=260),  # nothing cached, too long: the prefill kernel
        Req(fresh(c, 70)),  # a decode
    ]
    scene = Scene(reqs, heads, kv_heads, dim=dim, dtype=dtype)
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    meta = scene.check(native_backend(scene), atol=atol)
    assert meta.native is not None
    assert sorted(meta.native.n_new.tolist()) == [1, 2, 16, 17, 20, 33]
    assert meta.prefill is not None and sorted(meta.prefill.n_new.tolist()) == [260, 300]
    assert not meta.extends  # SDPA takes nothing


def test_greedy_matches_transformers_with_the_native_kernel(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    plans = greedy_plans_match_transformers(model_dirs["llama"], monkeypatch, [150, 90, 40], 14,
                                            native=True)
    native_steps = [m for m in plans if m.native is not None]
    assert native_steps and all(m.cascade is None for m in native_steps)
    assert max(len(groups_of(m)) for m in native_steps) >= 2  # several prefixes grouped at once


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3", "fp8_e5m2", "fp8"])
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_pool_matches_naive_over_its_dequantized_values(
    kv_cache_dtype: str, heads: int, kv_heads: int, dtype: torch.dtype
) -> None:
    """The kernel reads int8 / fp8 codes in place, each (slot, head) row times its scale:
    grouped decodes, plain decodes and extends over a cached prefix against naive attention
    over the codes x scales; so does the prefill kernel (a long chunk)."""
    c = [1]
    shared = fresh(c, 150)  # past one chunk of dequantized keys (QCHUNK, 128)
    reqs = [
        Req(shared + fresh(c, 3)), Req(shared + fresh(c, 9)),  # one decode group
        Req(fresh(c, 33)),  # a plain decode
        Req(fresh(c, 20 + 17), extend=17),  # an extend over a cached prefix
        Req(fresh(c, 200 + 60), extend=60),  # causal rows across a chunk boundary
        Req(fresh(c, 5 + 300), extend=300),  # too long for the row kernel: the prefill one
    ]
    scene = Scene(reqs, heads, kv_heads, dim=64, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    assert scene.pool.k[0].element_size() == 1 and scene.pool.quantized
    # values up to 2x the other tests': float32 rounding grows with them
    meta = scene.check(native_backend(scene), atol=5e-5 if dtype == torch.float32 else 4e-2)
    assert meta.native is not None and sorted(meta.native.n_new.tolist()) == [1, 1, 1, 17, 60]
    assert meta.prefill is not None and meta.prefill.n_new.tolist() == [300]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_every_finite_fp8_code_decodes_as_torch_does(kv_cache_dtype: str) -> None:
    """A request with one key attends only to it, so its output is that key's V row: rows of
    V hold every finite fp8 code (subnormals included) with scale 1, and the kernel's outputs
    must equal torch's conversion of those codes exactly."""
    from banyan.mem.kv_pool import kv_code_dtype

    code_dtype = kv_code_dtype(kv_cache_dtype)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = codes.view(code_dtype).float().isfinite()
    codes = torch.where(finite, codes, torch.zeros_like(codes)).view(4, 1, 64)  # 4 rows, 1 head
    scene = Scene([Req([s]) for s in (1, 2, 3, 4)], 1, 1, dim=64, layers=1,
                  kv_cache_dtype=kv_cache_dtype)
    layer = scene.pool.layer(0)
    layer.v.view(torch.uint8)[1:5] = codes
    layer.v_scale[1:5] = 1.0
    backend = native_backend(scene)
    meta = backend.plan(scene.batch, scene.out_slots)
    q = torch.randn(4, 1, 64)
    out = torch.empty_like(q)
    assert meta.native is not None
    native_attention(q, layer, scene.table.table, meta.native, 0.125, out)
    # request i (batch position i) has slot i + 1, whose V row is codes[i]
    assert torch.equal(out, codes.view(code_dtype).float())


@pytest.mark.parametrize("extend", [1, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lone_request_shares_its_heads_between_threads(extend: int, dtype: torch.dtype) -> None:
    """One request is one slice: with fewer slices than threads, its KV heads are separate
    work items (one per thread); the result is the same attention."""
    scene = Scene([Req(fresh([1], 300 + extend), extend=extend)], 6, 3, dim=64, dtype=dtype)
    meta = scene.check(native_backend(scene), atol=1e-5 if dtype == torch.float32 else 2e-2)
    assert meta.native is not None and meta.native.n_new.tolist() == [extend]


def _pool(gen: torch.Generator, slots: int, kv_heads: int, dim: int, dtype: torch.dtype,
          int8: bool) -> tuple[torch.Tensor, ...]:
    """Random K, V of one layer -> (k, v, k_scale, v_scale): as dtype (no scales), or int8 codes
    with a scale per (slot, head) row (an int8 pool's, read in place)."""
    if not int8:
        k, v = (torch.randn(slots, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
        return k, v, None, None
    k, v = (torch.randint(-127, 128, (slots, kv_heads, dim), generator=gen, dtype=torch.int8)
            for _ in range(2))
    ks, vs = (torch.rand(slots, kv_heads, generator=gen) * 0.02 + 0.005 for _ in range(2))
    return k, v, ks, vs


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
            reqs: list[tuple[int, int]], k_scale: torch.Tensor | None = None,
            v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The row kernel over (context, new tokens) per request, each request's own table row
    (all naming the same slots), its new tokens' queries taken in order from q; an int8 pool
    with its scales."""
    from banyan.attention.native_plan import plan_native

    rows = table.repeat(len(reqs), 1).contiguous()
    starts = [sum(n for _, n in reqs[:i]) for i in range(len(reqs))]
    plan = plan_native(rows, list(range(len(reqs))), [c - n for c, n in reqs],
                       [n for _, n in reqs], starts, max_shared=0)
    out = torch.empty_like(q)
    attention_kernels.paged_attention(q, k, v, rows, plan.req_row, plan.req_len, plan.q_start,
                                      plan.n_new, plan.order, plan.group_start, plan.group_prefix,
                                      0.125, out, k_scale, v_scale)
    return out


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 1, 128), (6, 2, 64), (5, 5, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("int8", [False, True], ids=["pool-as-dtype", "int8-pool"])
@pytest.mark.parametrize("n", [200, 420, 600, 1000])
def test_a_token_gets_the_same_bits_decoded_alone_in_a_batch_or_in_a_check(
        heads: int, kv_heads: int, dim: int, dtype: torch.dtype, int8: bool, n: int) -> None:
    """The bits of a query row's attention depend only on its query and its keys: decoded alone
    (its KV heads shared among the threads), among other decodes of a step, or as one row of a
    13-token extend (a speculative check), on 1 or 2 threads. Speculation and batching then
    change no output: a lone decode once split its keys between the threads and merged the
    parts, and bf16 rows of a KV head fewer than 4 took scores by another summation (each
    gave other last bits, and greedy text with speculation on parted from it off). So over an
    int8 pool (its bf16 queries' scores in int8 on VNNI: 4 or more rows and fewer take them
    alike). n keys: 1 part (decodes by KV head), 2 (a decode's whole from the first of them
    on, by head before: its short last part), 3 (whole decodes, a check's by head) and 4
    (whole parts for both)."""
    gen = torch.Generator().manual_seed(heads * dim)
    e = 13
    k, v, ks, vs = _pool(gen, n + 1, kv_heads, dim, dtype, int8)
    q = torch.randn(e, heads, dim, generator=gen).to(dtype)
    table = torch.arange(1, n + 1, dtype=torch.int32)[None]
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            check = _attend(q, k, v, table, [(n, e)], ks, vs)
            batch = _attend(q, k, v, table, [(n - e + 1 + t, 1) for t in range(e)], ks, vs)
            alone = torch.cat([_attend(q[t:t + 1].contiguous(), k, v, table,
                                       [(n - e + 1 + t, 1)], ks, vs) for t in range(e)])
            assert torch.equal(alone, check) and torch.equal(batch, check)
            outs.append(check)
        assert torch.equal(outs[0], outs[1])
    finally:
        torch.set_num_threads(before)


def test_the_native_kernels_show_in_torch_profiles(llama_dir: Path) -> None:
    """torch.profiler cannot see into ctypes calls: the kernels are named ranges in its trace
    (while a profiler records), so a profile of a step counts the attention kernel's time."""
    from banyan import Engine, SamplingParams

    with Engine(str(llama_dir), dtype="float32", device="cpu", disable_tqdm=True,
                attention_backend="cpu-native") as engine:
        params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
        engine.generate(input_ids=[[5, 6, 7, 8]], sampling_params=params, use_tqdm=False)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            engine.generate(input_ids=[[9, 10, 11, 12, 13]], sampling_params=params,
                            use_tqdm=False)
    ranges = {e.key: e for e in prof.key_averages() if e.key.startswith("banyan::")}
    kernel = "banyan::layer_stack" if "banyan::layer_stack" in ranges else \
        "banyan::paged_attention"
    assert kernel in ranges and ranges[kernel].count >= 3, sorted(ranges)
    assert ranges[kernel].cpu_time_total > 0


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 1, 128), (5, 5, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared", [300, 1061])
@pytest.mark.parametrize("int8", [False, True], ids=["pool-as-dtype", "int8-pool"])
def test_a_decode_grouped_by_a_shared_prefix_gets_the_bits_it_has_alone(
        heads: int, kv_heads: int, dim: int, dtype: torch.dtype, shared: int,
        int8: bool) -> None:
    """Members of a decode group attend the shared prefix once for all of them, in whole parts
    of the kernel's (kPartKeys) with the same arithmetic as a request alone, and their own keys
    from there: each member's bits are those it has decoded alone (a lone request's check has
    them too: the test above), so who shares a step with whom, and whether speculation turns
    decodes into checks, changes no output. The pair tiles once took the shared part: other
    bits, and concurrent requests with one system prompt could part with speculation on."""
    from banyan.attention.native_plan import plan_native

    gen = torch.Generator().manual_seed(shared + dim)
    owns = [1, 40, 255, 256, 300, 700, 3, 90]
    total = shared + sum(owns)
    k, v, ks, vs = _pool(gen, total + 1, kv_heads, dim, dtype, int8)
    q = torch.randn(len(owns), heads, dim, generator=gen).to(dtype)
    width = shared + max(owns)
    table = torch.zeros(len(owns), width, dtype=torch.int32)
    start = shared + 1
    for i, own in enumerate(owns):
        table[i, :shared] = torch.arange(1, shared + 1)
        table[i, shared:shared + own] = torch.arange(start, start + own)
        start += own
    lens = [shared + own for own in owns]
    plan = plan_native(table, list(range(len(owns))), [n - 1 for n in lens], [1] * len(owns),
                       None)
    assert plan.group_prefix.tolist()[0] == shared  # one group, over the whole shared prefix
    grouped = torch.empty_like(q)
    attention_kernels.paged_attention(q, k, v, table, plan.req_row, plan.req_len, plan.q_start,
                                      plan.n_new, plan.order, plan.group_start, plan.group_prefix,
                                      0.125, grouped, ks, vs)
    for i, n in enumerate(lens):
        alone = _attend(q[i:i + 1].contiguous(), k, v, table[i:i + 1, :n].contiguous(),
                        [(n, 1)], ks, vs)
        assert torch.equal(alone, grouped[i:i + 1]), f"member {i} ({n} keys)"
