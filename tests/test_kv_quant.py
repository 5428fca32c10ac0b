"""The quantized KV cache (`--kv-cache-dtype int8|fp8_e4m3|fp8_e5m2|fp8`) at the engine level: the
same memory holds more tokens, outputs do not depend on how the work is batched, chunked or
cached, quality stays close to the unquantized cache, and bad names are refused. (The kernel
against float64 attention over the codes x scales: test_native_attention.py; the cascade:
test_cascade_attention.py; the P/D transfer and the KV tier: test_disagg.py, test_kv_tier.py.)"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from banyan import Engine, SamplingParams
from banyan.args import EngineArgs
from banyan.mem.kv_pool import KVPool, dequantize_rows, quantize_rows

QUANTIZED = ["int8", "fp8_e4m3", "fp8_e5m2", "fp8"]  # fp8: one unit scale for the pool


def _engine(model: Path, **kw: object) -> Engine:
    args: dict[str, object] = dict(dtype="float32", device="cpu", disable_tqdm=True,
                                   kv_cache_memory="2MiB")
    args.update(kw)
    return Engine(str(model), **args)


@pytest.mark.parametrize("code_dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
def test_rows_round_trip_within_the_format_step(code_dtype: torch.dtype) -> None:
    """Each int8 row keeps its largest magnitude (up to the scale's rounding), and every value is
    within half a code step (int8) or the format's relative precision (fp8) of that magnitude."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=g) * torch.logspace(-4, 3, 50)[:, None, None]
    codes, scale = quantize_rows(x, code_dtype)
    assert codes.dtype == code_dtype and scale.shape == (50, 3)
    back = dequantize_rows(codes, scale, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    step = {torch.int8: 0.5 / 127, torch.float8_e4m3fn: 2**-4, torch.float8_e5m2: 2**-3}
    assert ((back - x).abs() <= amax * step[code_dtype] * 1.001).all()
    if code_dtype == torch.int8:
        torch.testing.assert_close(back.abs().amax(-1), amax.squeeze(-1), rtol=1e-6, atol=0)


def _max_scaled(x: torch.Tensor, code_dtype: torch.dtype) -> torch.Tensor:
    """x quantized with its rows' largest magnitude on the format's largest, then dequantized."""
    scale = x.abs().amax(-1, keepdim=True) / torch.finfo(code_dtype).max
    return (x / scale).to(code_dtype).float() * scale


@pytest.mark.parametrize("code_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_rows_take_the_scale_closest_to_them(code_dtype: torch.dtype) -> None:
    """Each fp8 row is no farther from x than the max-scaled codes (one of the scales tried),
    and over Gaussian rows the squared error drops by more than a tenth (measured: ~16%)."""
    x = torch.randn(2000, 3, 64, generator=torch.Generator().manual_seed(1))
    codes, scale = quantize_rows(x, code_dtype)
    err = (dequantize_rows(codes, scale, torch.float32) - x).square().sum(-1)
    plain = (_max_scaled(x, code_dtype) - x).square().sum(-1)
    assert (err <= plain * (1 + 1e-6)).all()
    assert err.sum() < 0.9 * plain.sum()


@pytest.mark.parametrize("code_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("head_dim", [8, 40, 64, 72])
def test_fp8_native_rows_equal_the_torch_rule(code_dtype: torch.dtype, head_dim: int,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """cpu_kv_quant.cpp's rows bit for bit those of quantize_rows' torch composition (16-wide
    blocks and tails; zero rows, float32 denormals, magnitudes from 1e-30 to 1e30)."""
    from banyan.kernels import fused_ops, native

    if native.load() is None:
        pytest.skip("native kernels unavailable")
    g = torch.Generator().manual_seed(head_dim)
    x = torch.randn(300, 2, head_dim, generator=g) * torch.logspace(-30, 30, 300)[:, None, None]
    x[0] = 0.0
    x[1, 0, :5] = 1e-39
    fast_codes, fast_scale = quantize_rows(x, code_dtype)
    monkeypatch.setattr(fused_ops, "fp8_quantize_rows", lambda *args: None)
    codes, scale = quantize_rows(x, code_dtype)
    assert torch.equal(fast_codes.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(fast_scale, scale)


@pytest.mark.parametrize("code_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("head_dim", [8, 40, 64, 72])
def test_unit_scale_rows_are_the_clamped_values_codes(code_dtype: torch.dtype, head_dim: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Without row scales (--kv-cache-dtype fp8): the codes of x clamped to the format's largest
    finite, no scale; the native rows (the layer stack's store) bit for bit the same, 16-wide
    blocks and tails; dequantized, the codes' values exactly (float32 and bf16, native or not)."""
    from banyan.kernels import fused_ops, native

    g = torch.Generator().manual_seed(head_dim)
    x = torch.randn(300, 2, head_dim, generator=g) * torch.logspace(-12, 6, 300)[:, None, None]
    x[0] = 0.0
    top = float(torch.finfo(code_dtype).max)
    codes, scale = quantize_rows(x, code_dtype, row_scales=False)
    assert scale is None and codes.dtype == code_dtype
    want = x.clamp(-top, top).to(code_dtype)  # torch's rounding: to nearest even
    assert torch.equal(codes.view(torch.uint8), want.view(torch.uint8))
    assert torch.isfinite(codes.float()).all() and codes.float().abs().max() == top
    fn = fused_ops._fp8_rows("quantize", code_dtype)
    if native.load() is not None and fn is not None:
        fast = torch.empty(x.shape, dtype=torch.uint8)
        fn(x.contiguous().data_ptr(), x.numel() // head_dim, head_dim, None, 0,
           fast.data_ptr(), None, 1)
        assert torch.equal(fast, codes.view(torch.uint8))
    for dtype in (torch.float32, torch.bfloat16):
        fast_values = dequantize_rows(codes, None, dtype)
        monkeypatch.setattr(fused_ops, "fp8_dequantize_rows", lambda *args: None)
        assert torch.equal(dequantize_rows(codes, None, dtype), fast_values)
        assert torch.equal(fast_values, codes.float().to(dtype))
        monkeypatch.undo()
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        quantize_rows(x, torch.int8, row_scales=False)


@pytest.mark.parametrize("code_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_native_dequantizing_equals_the_torch_rule(code_dtype: torch.dtype,
                                                      dtype: torch.dtype,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """cpu_kv_quant.cpp's rows of values bit for bit dequantize_rows' torch composition: every
    finite code (subnormals too) times scales from 1e-30 to 1e3 (products down into float32's
    denormals), rounded to bf16 once; rows of 24 values (no 16-wide rows) take torch's."""
    from banyan.kernels import fused_ops, native

    if native.load() is None or not native.load().banyan_fp8_dequantize_here():
        pytest.skip("native fp8 dequantizer unavailable")
    g = torch.Generator().manual_seed(5)
    codes = torch.arange(256, dtype=torch.uint8).repeat(64, 1)[:, torch.randperm(256,
                                                                              generator=g)]
    codes = codes.reshape(-1, 2, 64)  # [128, 2, 64]
    finite = torch.isfinite(torch.arange(256, dtype=torch.uint8).view(code_dtype).float())
    codes[~finite[codes.long()]] = 0  # the pool holds finite codes only
    scale = torch.rand(128, 2, generator=g) * torch.logspace(-30, 3, 128)[:, None]
    codes = codes.view(code_dtype)
    native_rows = fused_ops.fp8_dequantize_rows
    fast = native_rows(codes, scale, dtype)
    assert fast is not None and native_rows(codes[..., :24].contiguous(), scale, dtype) is None
    monkeypatch.setattr(fused_ops, "fp8_dequantize_rows", lambda *args: None)
    want = dequantize_rows(codes, scale, dtype)  # the torch composition
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert fast.dtype == dtype and torch.equal(fast.view(bits), want.view(bits))


def test_the_same_memory_holds_more_tokens(llama_dir: Path) -> None:
    with _engine(llama_dir, kv_cache_dtype="auto") as plain:
        base = plain.core.kv_capacity
        per_token = plain.core.kv_bytes_per_token
    for name in QUANTIZED:
        with _engine(llama_dir, kv_cache_dtype=name) as quant:
            pool = quant.core.scheduler.runner.model_runner.pool
            assert pool.quantized and pool.k[0].element_size() == 1
            assert pool.kv_cache_dtype == name
            head_dim = pool.head_dim
            # float32 values (4 bytes) become a byte each, plus a 4-byte scale per head where
            # rows keep scales (fp8: exactly a quarter of float32's bytes, half of bf16's)
            scale = 0 if name == "fp8" else 4
            assert quant.core.kv_bytes_per_token * 4 * head_dim == per_token * (head_dim + scale)
            assert quant.core.kv_capacity + 1 == (base + 1) * 4 * head_dim // (head_dim + scale)


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8"])
def test_outputs_do_not_depend_on_batching_chunking_or_caching(llama_dir: Path,
                                                               name: str) -> None:
    """Every reader sees the dequantized values, fresh tokens included: a prompt computed in
    one chunk, in small chunks, beside others, or over a cached prefix gives the same text."""
    rng = random.Random(11)
    system = [rng.randrange(3, 500) for _ in range(150)]
    prompts = [system + [rng.randrange(3, 500) for _ in range(n)] for n in (5, 40, 90)]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    alone = []
    for p in prompts:  # a fresh engine each: nothing cached, one chunk
        with _engine(llama_dir, kv_cache_dtype=name, no_prefix_cache=True) as engine:
            alone.append(engine.generate(input_ids=[p], sampling_params=params,
                                         use_tqdm=False)[0].outputs[0].output_ids)
    with _engine(llama_dir, kv_cache_dtype=name, chunked_prefill_size=32) as engine:
        together = [o.outputs[0].output_ids for o in engine.generate(
            input_ids=prompts, sampling_params=params, use_tqdm=False)]
        again = [o.outputs[0].output_ids for o in engine.generate(  # the system prompt cached
            input_ids=prompts, sampling_params=params, use_tqdm=False)]
        assert engine.core.stats().prefix_hit > 0
    assert together == alone and again == alone


def test_quality_stays_close_to_the_unquantized_cache(llama_dir: Path) -> None:
    """Teacher-forced log-probabilities of a prompt: int8 within 0.02 of the float32 cache on
    average, fp8 (fewer mantissa bits) within 0.1."""
    rng = random.Random(12)
    prompt = [rng.randrange(3, 500) for _ in range(200)]
    params = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=0)

    def logprobs(name: str) -> torch.Tensor:
        found = []
        with _engine(llama_dir, kv_cache_dtype=name) as engine:
            engine.add_request(input_ids=prompt, params=params)
            while engine.core.has_work:
                found += [e.logprob for u in engine.step() for e in u.prompt_logprobs or ()]
        assert len(found) == len(prompt) - 1
        return torch.tensor(found)

    plain = logprobs("auto")
    for name, bound in (("int8", 0.02), ("fp8_e4m3", 0.1), ("fp8_e5m2", 0.1), ("fp8", 0.1)):
        diff = (logprobs(name) - plain).abs()
        assert 0 < diff.mean() < bound, name  # 0 would mean the codes were never read


def test_unknown_kv_cache_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        KVPool(1, 4, 1, 8, torch.float32, "cpu", torch.float16)


def test_fp8_is_vllms_per_tensor_e4m3() -> None:
    """--kv-cache-dtype fp8 is vLLM's layout: e4m3 codes, one unit scale for the pool, so a
    storage of its own name (server_info, the KV tier's and P/D's layout checks tell it from
    fp8_e4m3's scaled rows); no other code goes without row scales."""
    from banyan.mem.kv_pool import kv_code_dtype, kv_row_scales

    assert EngineArgs(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    assert kv_code_dtype("fp8") == torch.float8_e4m3fn and not kv_row_scales("fp8")
    assert all(kv_row_scales(n) for n in ("auto", "int8", "fp8_e4m3", "fp8_e5m2"))
    pool = KVPool.named(1, 4, 1, 8, torch.bfloat16, "cpu", "fp8")
    assert pool.kv_cache_dtype == "fp8" and pool.layer(0).k_scale is None
    assert pool.bytes_per_slot * 2 == KVPool.named(1, 4, 1, 8, torch.bfloat16, "cpu").bytes_per_slot
    assert KVPool.named(1, 4, 1, 8, torch.bfloat16, "cpu", "fp8_e4m3").kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        KVPool(1, 4, 1, 8, torch.float32, "cpu", torch.int8, row_scales=False)
