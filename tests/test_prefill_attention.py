"""The blocked prefill attention kernel (banyan/kernels/cpu_prefill_attention.cpp) through the
cpu-native backend, against a float64 softmax attention (tests.test_attention.naive): ragged
prefixes, chunks around the edges of its query and key tiles, MHA / GQA 3 and 4 / MQA, head dims
64, 128, 96 and 40 (not a multiple of the tiles' vector width), float32 and bf16 (on AVX512-BF16
CPUs through the pair path), quantized pools, table rows with holes, several chunks in one step
beside the row kernel's decodes and short extends, outputs independent of the thread count, and
greedy generation against the SDPA backend."""

from __future__ import annotations

import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from banyan import Engine, SamplingParams
from banyan.attention import cpu_native, prefill_choice
from banyan.attention.cpu_native import CpuNativeBackend, NativeMetadata
from banyan.attention.prefill_choice import PrefillTimes
from banyan.kernels import attention_kernels, native
from tests.test_cascade_attention import Req, Scene, fresh

pytestmark = pytest.mark.skipif(
    native.load() is None, reason="native CPU kernels unavailable (no C++ compiler?)"
)

KEY_BLOCK = 64  # the kernel's BK


def query_tile(group: int) -> int:
    """The kernel's query positions per work item for G query heads per KV head (before it
    halves them for want of items; a row's result does not depend on it)."""
    bq = 64
    while bq > 8 and bq * group > 192:
        bq //= 2
    return bq


def scattered(counter: list[int], n: int, seed: int) -> list[int]:
    """n slots never used before, out of order and with holes between them."""
    return random.Random(seed).sample(fresh(counter, 2 * n), n)


def prefill_backend(scene: Scene, tiles: int = 0) -> CpuNativeBackend:
    """Every extend (2 tokens and more) on the prefill kernel, decodes on the row kernel; the
    kernel's products on `tiles` (1: emulated, 2: AMX)."""
    return CpuNativeBackend(scene.pool, scene.table, max_extend=1, prefill_kernel=True,
                            tiles=tiles)


# The tile path (cpu_prefill_tiles.h): emulated in memory wherever it is built, and on AMX
# itself where this CPU has it.
TILES = [t for t in (1, 2) if native.prefill_tiles() >= t]
needs_tiles = pytest.mark.skipif(not TILES, reason="no tile path in this build (not AVX512-BF16)")


def tile_edge_requests(group: int) -> list[Req]:
    """(prefix, chunk) around the query tile (bq - 1, bq, bq + 1), the key block (contexts of
    63 / 64 / 65 / 128 keys, chunks ending in a block's first key) and several blocks; no
    prefix, one key, odd ones; slots scattered; and a decode."""
    bq, c = query_tile(group), [1]
    shapes = [(0, bq - 1), (0, bq), (1, bq + 1), (37, 2 * bq + 1), (KEY_BLOCK - 3, 2),
              (KEY_BLOCK - 2, 2), (KEY_BLOCK - 1, 2), (KEY_BLOCK, KEY_BLOCK), (200, 3),
              (KEY_BLOCK + 1, 70)]
    reqs = [Req(scattered(c, p + n, seed=i), extend=n) for i, (p, n) in enumerate(shapes)]
    return reqs + [Req(fresh(c, 40))]


# (heads, KV heads, head dim): MHA, GQA 3 and 4, MQA at 64; the other dims on fewer of them
# (96: the bf16 pair path's 32-column tiles; 40: no pair path)
SHAPES = [(4, 4, 64), (6, 2, 64), (8, 2, 64), (6, 1, 64), (6, 2, 128), (8, 2, 128), (6, 2, 96),
          (4, 4, 40), (6, 1, 40)]


@pytest.mark.parametrize("heads,kv_heads,dim", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_match_the_reference(heads: int, kv_heads: int, dim: int,
                                    dtype: torch.dtype) -> None:
    reqs = tile_edge_requests(heads // kv_heads)
    scene = Scene(reqs, heads, kv_heads, dim=dim, dtype=dtype, layers=1)
    # float32: the kernel's rounding is ~1e-6 of the values; bf16: the output's own rounding
    meta = scene.check(prefill_backend(scene), atol=1e-5 if dtype == torch.float32 else 2e-2)
    assert meta.prefill is not None and meta.prefill.num_tokens == len(scene.out_slots) - 1
    assert meta.native is not None and meta.native.n_new.tolist() == [1]
    assert not meta.extends and meta.dec_count == 0  # nothing on SDPA


@needs_tiles
@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("heads,kv_heads,dim", [s for s in SHAPES if s[2] % 32 == 0])
def test_chunks_on_tiles_match_the_reference(heads: int, kv_heads: int, dim: int,
                                             tiles: int) -> None:
    """The products on tiles: every tile edge of the pair path's requests, 2 x 2 output tiles
    of 16 (keys and rows past a block's own: stale or padding, never read)."""
    reqs = tile_edge_requests(heads // kv_heads)
    scene = Scene(reqs, heads, kv_heads, dim=dim, dtype=torch.bfloat16, layers=1)
    meta = scene.check(prefill_backend(scene, tiles), atol=2e-2)
    assert meta.prefill is not None and not meta.extends


@needs_tiles
@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump (binutils)")
def test_the_tile_instructions_are_the_emulated_ones() -> None:
    """What the emulation cannot see on a CPU without AMX: the built library's tdpbf16ps
    instructions are the four products SoftTiles::dot computes (C = 2 (A - 4) + (B - 6))."""
    lib = native.load()
    assert lib is not None
    listing = subprocess.run(["objdump", "-d", "-M", "intel", lib._name], capture_output=True,
                             text=True, check=True).stdout
    found = set(re.findall(r"tdpbf16ps\s+tmm(\d),tmm(\d),tmm(\d)", listing))
    assert found == {("0", "4", "6"), ("1", "4", "7"), ("2", "5", "6"), ("3", "5", "7")}
    loads = set(re.findall(r"tileloadd\s+tmm(\d),", listing))
    stores = set(re.findall(r"tilestored\s+\[[^]]+\],tmm(\d)", listing))
    assert loads == {str(t) for t in range(8)} and stores == {"0", "1", "2", "3"}


@needs_tiles
@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e5m2", "fp8"])
def test_quantized_pools_on_tiles(kv_cache_dtype: str, tiles: int) -> None:
    c = [1]
    shapes = [(0, 33), (150, 65), (5, 130)]
    reqs = [Req(scattered(c, p + n, seed=i), extend=n) for i, (p, n) in enumerate(shapes)]
    scene = Scene(reqs, 6, 2, dim=64, dtype=torch.bfloat16, kv_cache_dtype=kv_cache_dtype,
                  layers=1)
    meta = scene.check(prefill_backend(scene, tiles), atol=4e-2)
    assert meta.prefill is not None and meta.prefill.n_new.tolist() == [33, 65, 130]


@needs_tiles
@pytest.mark.parametrize("tiles", TILES)
def test_tiles_agree_with_the_pair_path(tiles: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The start-up check an AMX CPU runs before its tiles take chunks (prefill_choice), here
    on the tiles this CPU has; a tile path whose output is off (one key block's worth of
    weight moved) or not finite fails it."""
    assert prefill_choice.tiles_agree(2, 64, tiles=tiles, tokens=120)
    kernel = attention_kernels.prefill_attention

    def off_by(shift: float) -> None:
        def wrong(*args: object, tiles: int = 0) -> torch.Tensor:
            out = kernel(*args, tiles=tiles)  # type: ignore[arg-type]
            return out + shift if tiles else out

        monkeypatch.setattr(attention_kernels, "prefill_attention", wrong)

    off_by(0.1)
    assert not prefill_choice.tiles_agree(2, 64, tiles=tiles, tokens=120)
    off_by(float("nan"))
    assert not prefill_choice.tiles_agree(2, 64, tiles=tiles, tokens=120)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3", "fp8_e5m2", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_pools_match_their_dequantized_values(kv_cache_dtype: str,
                                                        dtype: torch.dtype) -> None:
    """int8 / fp8 codes read in place, each (slot, head) row times its scale, against the
    reference over codes x scales."""
    c = [1]
    shapes = [(0, 33), (150, 65), (5, 130)]
    reqs = [Req(scattered(c, p + n, seed=i), extend=n) for i, (p, n) in enumerate(shapes)]
    scene = Scene(reqs, 6, 2, dim=64, dtype=dtype, kv_cache_dtype=kv_cache_dtype, layers=1)
    assert scene.pool.quantized
    meta = scene.check(prefill_backend(scene), atol=5e-5 if dtype == torch.float32 else 4e-2)
    assert meta.prefill is not None and meta.prefill.n_new.tolist() == [33, 65, 130]


def test_a_step_of_long_chunks_decodes_and_short_extends() -> None:
    """The engine's split: decodes and chunks up to max_extend on the row kernel, longer chunks
    (several requests in one call) on the prefill kernel, both writing one output."""
    c = [1]
    system = fresh(c, 80)
    reqs = [
        Req(system + fresh(c, 3)),  # decodes sharing a prefix: a row-kernel group
        Req(fresh(c, 300), extend=300),  # a fresh prefill
        Req(system + fresh(c, 9)),
        Req(fresh(c, 20 + 12), extend=12),  # short: the row kernel
        Req(scattered(c, 500 + 100, seed=3), extend=100),  # a chunk over a cached prefix
        Req(fresh(c, 17 + 40), extend=40),
    ]
    scene = Scene(reqs, 6, 2, dim=64)
    backend = CpuNativeBackend(scene.pool, scene.table, max_extend=16, prefill_kernel=True)
    meta = scene.check(backend)
    assert meta.native is not None and sorted(meta.native.n_new.tolist()) == [1, 1, 12]
    assert meta.prefill is not None and meta.prefill.n_new.tolist() == [300, 100, 40]
    assert not meta.extends


def test_switched_off_the_long_chunks_take_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    """BANYAN_NATIVE_PREFILL=0 (the benchmarks' "before"): chunks past max_extend on SDPA."""
    monkeypatch.setenv(cpu_native.PREFILL_SWITCH, "0")
    c = [1]
    scene = Scene([Req(fresh(c, 100), extend=100), Req(fresh(c, 30))], 6, 2, dim=64)
    backend = CpuNativeBackend(scene.pool, scene.table, max_extend=16)
    meta = scene.check(backend)
    assert meta.prefill is None and [e.length for e in meta.extends] == [100]


def long_chunk_path(monkeypatch: pytest.MonkeyPatch, amx: bool, times: PrefillTimes,
                    dtype: torch.dtype = torch.bfloat16, codes: str | None = None) -> str:
    """Where a default backend sends a fresh 100-token chunk on a CPU with or without AMX whose
    start-up probe measured `times` ("kernel" or "sdpa"; the probe must not run without AMX).
    A 40-token chunk over a cached prefix beside it stays on the kernel either way."""
    monkeypatch.delenv(cpu_native.PREFILL_SWITCH, raising=False)
    monkeypatch.setattr(prefill_choice.native, "amx_here", lambda: amx)
    probed: list[int] = []

    def measure(kv_heads: int, head_dim: int, dt: torch.dtype, tiles: int) -> PrefillTimes:
        probed.append(kv_heads)
        assert (head_dim, dt) == (64, dtype)
        return times

    monkeypatch.setattr(prefill_choice, "time_prefill_paths", measure)
    # the route taken anew (the process's is cached, and must not keep these fake times)
    monkeypatch.setattr(cpu_native, "prefill_route", prefill_choice.prefill_route.__wrapped__)
    c = [1]
    scene = Scene([Req(fresh(c, 100), extend=100), Req(fresh(c, 30)),
                   Req(fresh(c, 200 + 40), extend=40)], 6, 2, dim=64,
                  dtype=dtype, kv_cache_dtype=codes or "auto")
    meta = scene.check(CpuNativeBackend(scene.pool, scene.table, max_extend=16),
                       atol=1e-5 if dtype == torch.float32 else 4e-2)
    assert probed == ([2] if amx and dtype == torch.bfloat16 and codes is None else [])
    assert meta.prefill is not None and 40 in meta.prefill.n_new.tolist()
    if 100 in meta.prefill.n_new.tolist():
        assert not meta.extends
        return "kernel"
    assert [e.length for e in meta.extends] == [100]
    return "sdpa"


def test_on_an_amx_cpu_the_faster_path_measured_takes_long_chunks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """SDPA runs on AMX tiles where the CPU has them: the start-up probe decides, by a margin."""
    faster, close = PrefillTimes(2e-3, 1e-3), PrefillTimes(2e-3, 1.9e-3)
    assert long_chunk_path(monkeypatch, True, faster) == "sdpa"
    assert long_chunk_path(monkeypatch, True, close) == "kernel"
    assert long_chunk_path(monkeypatch, True, PrefillTimes(1e-3, 2e-3)) == "kernel"
    # no probe without AMX, for a float32 model, or over a quantized pool
    assert long_chunk_path(monkeypatch, False, faster) == "kernel"
    assert long_chunk_path(monkeypatch, True, faster, dtype=torch.float32) == "kernel"
    assert long_chunk_path(monkeypatch, True, faster, codes="int8") == "kernel"
    monkeypatch.setenv(cpu_native.PREFILL_SWITCH, "1")  # the switch overrides the probe
    c = [1]
    scene = Scene([Req(fresh(c, 100), extend=100)], 6, 2, dim=64, dtype=torch.bfloat16)
    assert CpuNativeBackend(scene.pool, scene.table, max_extend=16).prefill_kernel


def test_the_probe_times_both_paths() -> None:
    times = prefill_choice.time_prefill_paths(2, 64, torch.float32, tokens=96, rounds=1)
    assert 0 < times.kernel_s < 1 and 0 < times.sdpa_s < 1


@pytest.mark.parametrize("dtype,tiles", [(torch.float32, 0), (torch.bfloat16, 0),
                                         *((torch.bfloat16, t) for t in TILES)])
def test_the_output_does_not_depend_on_the_thread_count(dtype: torch.dtype, tiles: int) -> None:
    """The kernel shrinks its query blocks when it has fewer work items than threads; each row's
    arithmetic stays the same, so the bits do too (the engine may change its thread count
    between steps); on tiles as well."""
    c = [1]
    scene = Scene([Req(fresh(c, 90 + 70), extend=70)], 6, 3, dim=64, dtype=dtype, layers=1)
    backend = prefill_backend(scene, tiles)
    meta = backend.plan(scene.batch, scene.out_slots)
    assert isinstance(meta, NativeMetadata) and meta.prefill is not None
    q = torch.randn(70, 6, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    k, v = (x[scene.out_slots].to(dtype) for x in scene.values(0))
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3, 16):
            torch.set_num_threads(threads)
            outs.append(backend.forward(q, k, v, 0, meta))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_greedy_matches_the_sdpa_backend(model_dirs: dict[str, Path],
                                         monkeypatch: pytest.MonkeyPatch, arch: str) -> None:
    """Prompts prefilled in chunks of up to 96 tokens through the prefill kernel (max_extend 16,
    as on AVX2 CPUs, so AVX-512 ones send the chunks there too) give SDPA's greedy tokens."""
    calls = []
    kernel = cpu_native.prefill_attention

    def counted(*args: object) -> torch.Tensor:
        calls.append(1)
        return kernel(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_native, "prefill_attention", counted)
    monkeypatch.setattr(cpu_native, "default_max_extend", lambda *dtypes: 16)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (250, 97, 20)]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = {}
    for backend in ("sdpa", "cpu-native"):
        with Engine(str(model_dirs[arch]), dtype="float32", device="cpu", disable_tqdm=True,
                    attention_backend=backend, chunked_prefill_size=96,
                    max_prefill_tokens=96) as engine:
            outs = engine.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)
            outputs[backend] = [o.output_ids for o in outs]
    assert calls  # the chunks did go through the kernel
    assert outputs["cpu-native"] == outputs["sdpa"]


@needs_tiles
@pytest.mark.parametrize("tiles", [0, *TILES])
def test_the_layer_stacks_entry_runs_the_tile_mode_it_is_given(tiles: int) -> None:
    """The layer stack calls banyan_prefill_attention_stack_bf16 with its step's tile mode (the
    per-op path's, CpuNativeBackend.tiles): its output has the bits the per-op entry gives in
    that mode, on scores whose sum order shows. Key 0 against a query of ones: 2^24, 0, 1,
    -2^24 in its first dims. Tiles emulated as tdpbf16ps is defined add a pair's products one
    by one, even dim first (2^24 + 1 rounds back: a score of 0); the pair path's vdpbf16ps does
    not (1): key 0's weight against key 1's (a score of 0 either way) differs."""
    d, slots = 64, 2
    q = torch.ones(1, 1, d).bfloat16()
    k = torch.zeros(slots, 1, d)
    k[0, 0, :4] = torch.tensor([2.0**24, 0.0, 1.0, -2.0**24])
    v = torch.zeros(slots, 1, d)
    v[0] = 1.0  # the output: key 0's weight
    k, v = k.bfloat16(), v.bfloat16()
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    req = [torch.tensor([x], dtype=torch.int64) for x in (0, 2, 0, 1)]  # row, len, start, new
    args = (q, k, v, table, *req, 1.0)
    per_op = attention_kernels.prefill_attention(*args, torch.empty_like(q), tiles=tiles)
    stack = torch.empty_like(q)
    lib = native.load()
    assert lib is not None
    lib.banyan_prefill_attention_stack_bf16(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), None, None, table.data_ptr(), 2,
        *(t.data_ptr() for t in req), 1, stack.data_ptr(), 1, 1, d, 1.0, 1, tiles)
    assert torch.equal(stack, per_op)
    weight = 1 / (1 + torch.e ** -1)  # key 0 scored 1, key 1 0
    if tiles == 0:
        assert abs(stack[0, 0, 0].item() - weight) < 1e-2
    elif tiles == 1:  # (AMX's own order is its own: only the bits above are asked of it)
        assert stack[0, 0, 0].item() == 0.5
