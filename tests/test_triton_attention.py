"""The "triton" attention backend against the SDPA backend, layer by layer, and end to end.

Without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set here before
triton is first imported), which executes each program in Python: about 10 ms per program or
key block, so the shapes are picked to cover the kernels' cases, not to be large. What the
interpreter covers here:

- decodes: contexts of 1 to 5,000 keys (1, 2, 63, 64, 65, 200, 777 with forced small splits,
  so empty and partial splits occur; 1,500, 3,000 and 5,000 with the default split policy, 16
  splits); GQA ratios 1, 4 and 8 (and a group of 2); head_dim 64 and 24 (padded to 32);
- extends of 2 to 300 new tokens over prefixes of 0 to 1,800 tokens (one to five 64-token
  query blocks), causal within the new tokens; mixed decode + extend steps with the decodes
  not contiguous in the flat batch;
- tables with holes (each row's slots scattered over the pool) and stale entries past every
  row's end (slots holding other data, some of them other rows' live slots);
- float32 and bfloat16 pools (a float16 one once). Under the interpreter bfloat16 products run
  in float32 (numpy has no bfloat16), so the GPU's bf16 tensor-core path is not what runs here;
- quantized pools (int8, fp8 e4m3 and e5m2 codes with a scale per row; e4m3 with one unit scale
  for the pool), read in place, against SDPA over the same codes dequantized; every one of the
  256 fp8 codes decoded as torch does.

On a CUDA machine the same tests run the compiled kernels on the GPU instead.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch

from tests.triton_device import DEVICE, skip_if_compiled_without_gpu

pytest.importorskip("triton")

from banyan import Engine, SamplingParams  # noqa: E402
from banyan.attention.registry import create_backend  # noqa: E402
from banyan.attention.torch_backend import SdpaBackend  # noqa: E402
from banyan.attention.triton_backend import SplitPolicy, TritonBackend  # noqa: E402
from banyan.kernels import triton_attention  # noqa: E402
from banyan.mem.kv_pool import KVPool, kv_code_dtype, quantize_rows  # noqa: E402
from banyan.mem.req_table import ReqToTokenTable  # noqa: E402
from tests.test_cascade_attention import Req, Scene  # noqa: E402

skip_if_compiled_without_gpu()

F32, BF16 = torch.float32, torch.bfloat16
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
SMALL_SPLITS = SplitPolicy(min_keys=64, max_splits=8)  # several splits on short contexts


def scattered(shapes: list[tuple[int, int]], seed: int = 0) -> list[Req]:
    """Requests of (prefix, new tokens) whose slots are disjoint and scattered over the pool
    (a table with holes: no row's slots are contiguous)."""
    total = sum(p + n for p, n in shapes)
    slots = list(range(1, 2 * total + 1))
    random.Random(seed).shuffle(slots)
    reqs, at = [], 0
    for p, n in shapes:
        reqs.append(Req(slots[at : at + p + n], extend=n))
        at += p + n
    return reqs


def compare(scene: Scene, backend: TritonBackend, layers: int | None = None) -> None:
    """Every layer (or the first `layers`) through both backends on the same q/k/v: outputs
    within the pool dtype's tolerance, and the new tokens' K/V stored by the Triton one."""
    sdpa = SdpaBackend(scene.pool, scene.table)
    slots = scene.out_slots
    metas = backend.plan(scene.batch, slots), sdpa.plan(scene.batch, slots)
    dtype, tol = scene.pool.dtype, TOL[scene.pool.dtype]
    for layer in range(scene.layers if layers is None else layers):
        shape = (len(slots), scene.heads, scene.pool.head_dim)
        q = torch.randn(shape, generator=scene.gen).to(dtype).to(slots.device)
        k_shape = (len(slots), scene.pool.kv_heads, scene.pool.head_dim)
        k, v = (torch.randn(k_shape, generator=scene.gen).to(dtype).to(slots.device)
                for _ in range(2))
        got = backend.forward(q, k, v, layer, metas[0])
        pool = scene.pool
        kv = pool.layer(layer)
        for x, codes, scales in ((k, kv.k, kv.k_scale), (v, kv.v, kv.v_scale)):
            if not pool.quantized:
                assert torch.equal(codes[slots], x)
                continue
            want_codes, want_scales = quantize_rows(x, pool.code_dtype, pool.row_scales)
            assert torch.equal(codes[slots].view(torch.uint8), want_codes.view(torch.uint8))
            assert (scales is None and want_scales is None) or \
                torch.equal(scales[slots], want_scales)
        want = sdpa.forward(q, k, v, layer, metas[1])
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def stale_live(reqs: list[Req]) -> dict[int, list[int]]:
    """Stale entries past each row's end that are other rows' live slots (a reused row)."""
    return {i: reqs[(i + 1) % len(reqs)].slots[:5] for i in range(len(reqs))}


@pytest.mark.parametrize("heads,kv_heads,dtype", [(2, 2, F32), (4, 1, F32), (8, 1, F32),
                                                  (2, 2, BF16), (4, 1, BF16), (8, 1, BF16)])
def test_decodes_with_small_splits(heads: int, kv_heads: int, dtype: torch.dtype) -> None:
    """Contexts 1..777 keys, 8 splits of >= 64 keys: empty, partial and full splits merge."""
    reqs = scattered([(n - 1, 1) for n in (1, 2, 63, 64, 65, 200, 777)], seed=heads)
    scene = Scene(reqs, heads, kv_heads, dim=64, dtype=dtype, layers=1, device=DEVICE,
                  stale=stale_live(reqs))
    backend = TritonBackend(scene.pool, scene.table, splits=SMALL_SPLITS)
    meta = backend.plan(scene.batch, scene.out_slots)
    assert meta.decode is not None and meta.decode.splits == 8 and meta.extend is None
    compare(scene, backend)


@pytest.mark.parametrize("heads,kv_heads,dtype", [(4, 1, F32), (8, 1, BF16)])
def test_long_decodes_default_splits(heads: int, kv_heads: int, dtype: torch.dtype) -> None:
    """Contexts of 1,500 to 5,000 keys with the default split policy (a GPU's 16 splits)."""
    reqs = scattered([(4999, 1), (1499, 1), (2999, 1), (4, 1)], seed=3)
    scene = Scene(reqs, heads, kv_heads, dim=64, dtype=dtype, layers=1, device=DEVICE)
    backend = TritonBackend(scene.pool, scene.table)
    meta = backend.plan(scene.batch, scene.out_slots)
    assert meta.decode is not None and meta.decode.splits == 16
    compare(scene, backend)


# (prefix, new tokens): one to five query blocks of 64, block edges, a speculative check
EXTENDS = [(0, 300), (37, 65), (500, 2), (1, 64), (130, 129)]


@pytest.mark.parametrize("heads,kv_heads,dtype", [(2, 2, F32), (4, 1, BF16), (8, 1, F32)])
def test_extends_over_prefixes(heads: int, kv_heads: int, dtype: torch.dtype) -> None:
    reqs = scattered(EXTENDS, seed=heads)
    scene = Scene(reqs, heads, kv_heads, dim=24, dtype=dtype, layers=1, device=DEVICE,
                  stale=stale_live(reqs))
    backend = TritonBackend(scene.pool, scene.table)
    meta = backend.plan(scene.batch, scene.out_slots)
    assert meta.decode is None and meta.extend is not None
    # one block per 64 new tokens: 5 + 2 + 1 + 1 + 3
    assert meta.extend.block_req.tolist() == [0] * 5 + [1] * 2 + [2, 3] + [4] * 3
    assert meta.extend.block_start.tolist() == [0, 64, 128, 192, 256, 0, 64, 0, 0, 0, 64, 128]
    compare(scene, backend)


def test_a_long_extend() -> None:
    """300 new tokens over a 1,800-token prefix."""
    reqs = scattered([(1800, 300)], seed=7)
    scene = Scene(reqs, 2, 1, dim=64, layers=1, device=DEVICE)
    compare(scene, TritonBackend(scene.pool, scene.table))


@pytest.mark.parametrize("dtype", [F32, BF16, torch.float16])
def test_mixed_decode_and_extend_step(dtype: torch.dtype) -> None:
    """Decodes between extends (not contiguous in the flat batch), two layers."""
    shapes = [(40, 1), (0, 9), (130, 1), (20, 70), (0, 1), (300, 1), (64, 3)]
    reqs = scattered(shapes, seed=11)
    scene = Scene(reqs, 8, 2, dim=64, dtype=dtype, device=DEVICE, stale=stale_live(reqs))
    backend = TritonBackend(scene.pool, scene.table, splits=SMALL_SPLITS)
    meta = backend.plan(scene.batch, scene.out_slots)
    assert meta.decode is not None and meta.extend is not None
    # each decode's token in the flat batch: after the 9 and the 70 new tokens of the extends
    assert meta.decode.tokens.tolist() == [0, 10, 81, 82]
    assert meta.decode.splits == 5  # ceil(301 / 64)
    compare(scene, backend)


def test_split_count() -> None:
    count = triton_attention.split_count
    assert count(1, 4000, 256, 16, 264) == 16  # one long decode: as many as allowed
    assert count(1, 1000, 256, 16, 264) == 4  # no split under 256 keys
    assert count(64 * 8, 4000, 256, 16, 264) == 1  # 512 programs fill the GPU already
    assert count(32, 4000, 256, 16, 264) == 9  # 32 x 9 = 288 programs >= 264
    assert count(1, 1, 256, 16, 264) == 1


QUANTIZED = ["int8", "fp8_e4m3", "fp8_e5m2", "fp8"]


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_decodes_over_a_quantized_pool(kv_cache_dtype: str, dtype: torch.dtype) -> None:
    """Codes read in place with their rows' scales, split contexts merged, GQA 4."""
    reqs = scattered([(n - 1, 1) for n in (1, 65, 200, 777)], seed=5)
    scene = Scene(reqs, 8, 2, dim=64, dtype=dtype, layers=1, device=DEVICE,
                  stale=stale_live(reqs), kv_cache_dtype=kv_cache_dtype)
    compare(scene, TritonBackend(scene.pool, scene.table, splits=SMALL_SPLITS))


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_extends_and_decodes_over_a_quantized_pool(kv_cache_dtype: str) -> None:
    """A mixed step (extends over cached prefixes, causal within the new tokens, beside
    decodes), head_dim 24 (padded), bfloat16 queries."""
    reqs = scattered([(37, 65), (130, 1), (0, 9), (300, 1), (64, 3)], seed=9)
    scene = Scene(reqs, 4, 2, dim=24, dtype=BF16, layers=1, device=DEVICE,
                  kv_cache_dtype=kv_cache_dtype)
    backend = TritonBackend(scene.pool, scene.table, splits=SMALL_SPLITS)
    meta = backend.plan(scene.batch, scene.out_slots)
    assert meta.decode is not None and meta.extend is not None
    compare(scene, backend)


@pytest.mark.parametrize("code_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_every_fp8_code_decodes_as_torch_does(code_dtype: torch.dtype) -> None:
    """One key a code: 256 slots whose single dimension holds code c (scale 1), attended by a
    one-hot query over exactly that key, gives back torch's value of c (NaN codes aside; inf
    codes of e5m2 too: the quantizer never writes them)."""
    codes = torch.arange(256, dtype=torch.uint8).view(code_dtype)
    finite = torch.isfinite(codes.float())
    values = []
    for c in range(256):
        if not finite[c]:
            values.append(float("nan"))
            continue
        pool = KVPool(1, 2, 1, 16, F32, DEVICE, code_dtype)
        row = torch.zeros(16, dtype=torch.uint8)
        row[0] = c
        for codes_, scales in ((pool.k[0], pool.k_scale[0]), (pool.v[0], pool.v_scale[0])):
            codes_.view(torch.uint8)[1, 0] = row.to(DEVICE)
            scales[1, 0] = 1.0
        table = ReqToTokenTable(1, 4, DEVICE)
        table.table[0, 0] = 1
        q = torch.zeros(1, 1, 16, device=DEVICE)
        out = torch.empty_like(q)
        mid_o, mid_lse = torch.empty(1, 1, 1, 16, device=DEVICE), torch.empty(1, 1, 1,
                                                                             device=DEVICE)
        ints = torch.tensor([[0], [1], [0]], dtype=torch.int32, device=DEVICE)
        triton_attention.decode_attention(q, pool.k[0], pool.v[0], table.table, ints[0],
                                          ints[1], ints[2], mid_o, mid_lse, 1.0, out,
                                          pool.k_scale[0], pool.v_scale[0])
        values.append(out[0, 0, 0].item())  # one key: its value, weight 1
    got = torch.tensor(values)
    assert torch.equal(got[finite], codes.float()[finite])


def test_refusals_and_auto() -> None:
    table = ReqToTokenTable(2, 16, "cpu")
    int8 = KVPool(1, 8, 2, 16, torch.float32, "cpu", kv_code_dtype("int8"))
    with pytest.raises(ValueError, match="needs its K and V scales"):
        triton_attention.decode_attention(
            torch.zeros(1, 2, 16), int8.k[0], int8.v[0], table.table, *torch.zeros(3, 1,
            dtype=torch.int32), torch.empty(1, 2, 1, 16), torch.empty(1, 2, 1), 1.0,
            torch.empty(1, 2, 16))
    meta = KVPool(1, 8, 2, 16, torch.float32, "meta")
    assert "runs on CUDA devices, not meta" in (TritonBackend.refusal(meta) or "")
    # On CPU auto keeps its order (the interpreter is a test tool), even with it switched on.
    cpu = KVPool(1, 8, 2, 16, torch.float32, "cpu")
    assert TritonBackend.supports(cpu) == (DEVICE == "cpu")
    assert create_backend("auto", cpu, table).name in ("cpu-native", "sdpa")
    if DEVICE == "cpu":
        assert create_backend("triton", cpu, table).name == "triton"


@pytest.mark.cuda
def test_auto_prefers_triton_on_cuda() -> None:
    pool = KVPool(1, 8, 2, 16, torch.bfloat16, "cuda")
    assert create_backend("auto", pool, ReqToTokenTable(2, 16, "cuda")).name == "triton"


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8_e4m3"])
def test_engine_greedy_matches_sdpa(llama_dir: Path, kv_cache_dtype: str) -> None:
    """The tiny llama (4 heads over 2 KV heads, head_dim 16): prompts of 5 and 90 tokens in
    chunks of 32 (extends over a cached prefix), then decodes, equal greedy tokens; over a
    quantized pool too (SDPA dequantizing what it gathers, the kernels reading the codes)."""
    prompts = [[5 + i for i in range(5)], [7 + (i * 13) % 400 for i in range(90)]]
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    outputs = {}
    for name in ("sdpa", "triton"):
        with Engine(str(llama_dir), dtype="float32", device=DEVICE, disable_tqdm=True,
                    attention_backend=name, chunked_prefill_size=32, max_prefill_tokens=64,
                    kv_cache_dtype=kv_cache_dtype) as engine:
            assert engine.core.scheduler.runner.model_runner.backend.name == name
            outputs[name] = [o.output_ids for o in engine.generate(input_ids=prompts,
                                                                   sampling_params=params)]
    assert outputs["triton"] == outputs["sdpa"]
    assert all(len(o) == 6 for o in outputs["sdpa"])


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_decode_graphs_replay_the_eager_step(dtype: torch.dtype) -> None:
    """The backend's CUDA-graph hooks under runner/cuda_graph.py, with the fake device of
    tests/test_cuda_graph.py (a replay re-runs what was captured over the static buffers):
    decode steps of 1 and 3 requests through captured buckets of up to 4 (3 padded to 4) give
    the eager step's attention (split counts differ: a bucket's is fixed for the longest
    possible context). Buckets of 8 doubled its time in Triton's interpreter (~14 s on a Zen 1)
    for nothing more: the padding is the same code at any size."""
    from banyan.runner.cuda_graph import DecodeGraphs
    from tests.test_cuda_graph import FakeGraphs

    reqs = scattered([(n - 1, 1) for n in (70, 1, 300, 129, 5)], seed=5)
    scene = Scene(reqs, 4, 2, dim=16, dtype=dtype, layers=1, device=DEVICE)
    backend = TritonBackend(scene.pool, scene.table, splits=SMALL_SPLITS)
    g = torch.Generator().manual_seed(2)
    weights = [torch.randn(64, h, 16, generator=g).to(dtype).to(DEVICE) for h in (4, 2, 2)]

    def forward(ids: torch.Tensor, pos: torch.Tensor, meta: object) -> torch.Tensor:
        q, k, v = (w[ids] for w in weights)
        return backend.forward(q, k, v, 0, meta)  # type: ignore[arg-type]

    api = FakeGraphs()
    graphs = DecodeGraphs(forward, backend, 4, torch.device(DEVICE), api)
    graphs.capture()
    assert graphs.captured == [1, 2, 4]
    for b in (1, 3):
        batch = dataclasses.replace(scene.batch, rows=scene.batch.rows[:b],
                                    prefix_lens=scene.batch.prefix_lens[:b],
                                    extend_lens=[1] * b, input_ids=list(range(1, b + 1)),
                                    out_slots=scene.batch.out_slots[:b])
        ids = torch.arange(1, b + 1, device=DEVICE)
        slots = scene.out_slots[:b]
        got = graphs.run(batch, ids, torch.tensor(batch.prefix_lens, device=DEVICE), slots)
        assert got is not None and api.replayed_rows() == graphs.bucket_for(b)
        want = forward(ids, ids, backend.plan(batch, slots))
        torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_engine_decodes_replayed_from_graphs_match_eager(llama_dir: Path) -> None:
    """The runner's graph path end to end (ModelRunner.enable_graphs with the fake device):
    three prompts decoding together, then fewer as they end (buckets 1, 2, 4 replayed with
    padded rows), give the greedy tokens of eager steps."""
    from tests.test_cuda_graph import FakeGraphs

    prompts = [[5 + i for i in range(5)], [9, 8, 7], [7 + (i * 13) % 400 for i in range(40)]]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
              for n in (3, 5, 7)]
    outputs, replays = {}, 0
    for graphs in (False, True):
        with Engine(str(llama_dir), dtype="float32", device=DEVICE, disable_tqdm=True,
                    attention_backend="triton", max_running_requests=4) as engine:
            if graphs:
                api = FakeGraphs()
                runner = engine.core.scheduler.runner.model_runner  # type: ignore[attr-defined]
                runner.enable_graphs(api)
                assert runner.graphs.captured == [1, 2, 4]
            outputs[graphs] = [o.output_ids for o in engine.generate(
                input_ids=prompts, sampling_params=params, use_tqdm=False)]
            if graphs:
                replays = sum(kind == "replay" for kind, _ in api.events)
    assert outputs[True] == outputs[False]
    assert replays >= 6  # decode steps of 3, 2 and 1 requests went through the graphs


def test_warmup_sizing_steps_through_triton(llama_dir: Path) -> None:
    """The KV sizing's warm-up step (runner/kv_sizing.py) over a temporary pool with the
    backend the GPU takes: chunks and decodes in one step, then the real pool and backend
    (the memory figures from a fake probe: no GPU here)."""
    from banyan.runner.model_runner import ModelRunner
    from tests.test_kv_sizing import FakeProbe

    probe = FakeProbe(free=2**20 + 2 * 50 * 512, step_peak=2**20)
    runner = ModelRunner(llama_dir, dtype="float32", device=DEVICE, mem_fraction=0.5,
                         max_rows=3, max_context=64, show_progress=False,
                         attention_backend="triton", cuda_graphs=False, warmup_tokens=20,
                         warmup_chunk=10, memory_probe=None if DEVICE == "cuda" else probe)
    assert runner.backend.name == "triton" and runner.backend.pool is runner.pool
    assert runner.kv_sizing is not None
    if DEVICE == "cpu":  # (512 bytes per token: 2 layers, 2 KV heads of 16 floats, K and V)
        assert runner.num_slots == 50 and "peak" in probe.events
