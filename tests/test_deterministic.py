"""--enable-deterministic-inference (runner/batch_invariant.py): each linear method's token bits
do not depend on the step's size, and an engine's greedy tokens and logprobs do not depend on
batching, chunking, the prefix cache, retraction or speculation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from banyan import Engine, SamplingParams
from banyan.args import EngineArgs
from banyan.attention.decode_tiles import tile_modes_here, tiles_mode
from banyan.demo import build_random_model
from banyan.kernels import native
from banyan.layers.gemm_tiles import set_gemm_tiles
from banyan.layers.f32_linear import SkinnyF32Method
from banyan.layers.linear import Linear, SkinnyBf16Method
from tests.test_engine import SETTINGS, check_pool_empty, prompts_1_to_300
from tests.test_quant import _quantized_layer

needs_kernels = pytest.mark.skipif(native.load() is None, reason="native kernels did not build")
# past every step-size switch of the methods: quantized layers' bf16 GEMM (17) and dequantized
# slabs (128), the dense bf16 pairs kernel's handover to oneDNN (256)
LONG_STEP = 300


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A random llama with SmolLM2's head size (64) and widths past one kernel pass (the tiny
    test models' 16-wide heads and 64-wide layers take no step-size-dependent path)."""
    return build_random_model(tmp_path_factory.mktemp("wide-llama"), "llama",
                              tokenizer_dir=tokenizer_dir, hidden_size=256,
                              intermediate_size=512, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2,
                              max_position_embeddings=1024)


def _layer(method: str, dtype: torch.dtype) -> Linear:
    torch.manual_seed(7)
    if method == "dense":
        layer = Linear.from_weight(torch.randn(70, 128).to(dtype), torch.randn(70).to(dtype))
        dense = SkinnyBf16Method if dtype == torch.bfloat16 else SkinnyF32Method
        if not dense.available(torch.device("cpu"), dtype):
            pytest.skip(f"{dense.__name__} does not run here")
        layer.convert(dense())
        return layer
    return _quantized_layer(method, 70, 256, True)


@needs_kernels
@pytest.mark.parametrize("method", ["dense", "int8", "int4g32", "int8g32", "int4-float32-scales"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_step_size_gives_each_token_its_bits_alone(method: str, dtype: torch.dtype) -> None:
    """A 300-token step (a long prompt chunk), 40 tokens and one alone give a token the same
    bits once the method is batch-invariant. Without it the long step takes another kernel
    (oneDNN, a GEMM over bf16-rounded weights or dequantized slabs): checked to part."""
    layer = _layer(method, dtype)
    x = torch.randn(LONG_STEP, layer.in_features).to(dtype)
    assert layer.method.can_be_batch_invariant
    with torch.inference_mode():
        plain = layer(x)
        layer.method.batch_invariant = True
        whole, head = layer(x), layer(x[:40])
        for t in (0, 1, 16, 17, 39, 127, 128, 255, 256, LONG_STEP - 1):
            alone = layer(x[t:t + 1])
            assert torch.equal(whole[t:t + 1], alone), t
            if t < 40:
                assert torch.equal(head[t:t + 1], alone), t
        # (in bf16, dense pairs and oneDNN may agree, and int8's short kernel and GEMM both sum
        # the exact products of its codes in float32: their outputs rounded to bf16 rarely part)
        if method not in ("dense", "int8") or dtype == torch.float32:
            assert not torch.equal(plain, whole)


def _runs(model: Path, prompts: list[list[int]], dtype: str,
          **kwargs: Any) -> list[tuple[list, list]]:
    """Greedy tokens and their logprobs (chosen + top 2) for each prompt."""
    params = [SamplingParams(max_new_tokens=20 + len(p) % 17, temperature=0.0, logprobs=2)
              for p in prompts]
    with Engine(str(model), dtype=dtype, device="cpu", disable_tqdm=True,
                enable_deterministic_inference=True, **kwargs) as engine:
        engine.core.scheduler.config.check_integrity = True
        outs = engine.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)
        # again: the prompts' K/V now come from the prefix cache (computed in other steps)
        again = engine.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)
        assert [o.output_ids for o in again] == [o.output_ids for o in outs]
        assert [o.logprobs for o in again] == [o.logprobs for o in outs]
        if kwargs.get("kv_cache_memory"):
            assert engine.core.scheduler.total_retractions > 0
        if kwargs.get("speculative_algorithm"):  # guesses were made and some accepted
            stats = engine.core.stats().spec
            assert stats is not None and stats.num_accepted_tokens > 0
        check_pool_empty(engine)
    return [(o.output_ids, [(lp.token_id, lp.logprob, lp.top_ids, lp.top_logprobs)
                            for lp in o.logprobs]) for o in outs]


@needs_kernels
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_tokens_and_logprobs_do_not_depend_on_the_schedule(wide_dir: Path, dtype: str) -> None:
    """One big step, 37-token chunks, a pool small enough to retract, ngram and draft
    speculation (4 guesses), and each prompt alone: the same greedy tokens and logprobs, bit for
    bit. (In bf16 without the flag the chunked run's second text parts from the big step's by its
    2nd token.)"""
    prompts = prompts_1_to_300(8, seed=5)
    want = _runs(wide_dir, prompts, dtype, **SETTINGS["one-big-step"])
    assert _runs(wide_dir, prompts, dtype, **SETTINGS["chunked"]) == want
    # 400 tokens of 2 layers x 2 KV heads x 64 x (K, V), 2 or 4 bytes each
    token_bytes = 2 * 2 * 64 * 2 * (2 if dtype == "bfloat16" else 4)
    small = dict(SETTINGS["retraction"], kv_cache_memory=str(400 * token_bytes))
    assert _runs(wide_dir, prompts, dtype, **small) == want
    assert _runs(wide_dir, prompts, dtype, speculative_algorithm="ngram", spec_ngram_min=1,
                 speculative_num_tokens=4, **SETTINGS["chunked"]) == want
    # the model as its own draft: every guess right, checked in steps of up to 5 tokens
    assert _runs(wide_dir, prompts, dtype, speculative_algorithm="draft",
                 spec_draft_model=str(wide_dir), spec_draft_min_confidence=0.0,
                 speculative_num_tokens=4, **SETTINGS["chunked"]) == want
    alone = [_runs(wide_dir, [p], dtype)[0] for p in prompts[:3]]
    assert alone == want[:3]


@needs_kernels
def test_an_amx_cpu_computes_what_others_do(wide_dir: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """On an AMX CPU (its flag faked) every dense bf16 layer of the mode is in the bf16 GEMM's
    pairs, every step through that kernel, and the tokens and logprobs are those of any other
    CPU with the kernels; with the GEMM's tiles left on, the mode turns them off."""
    if not SkinnyBf16Method.suits_here():
        pytest.skip("no AVX512-BF16 here")
    prompts = prompts_1_to_300(4, seed=9)
    want = _runs(wide_dir, prompts, "bfloat16", **SETTINGS["chunked"])
    monkeypatch.setattr(native, "amx_here", lambda: True)
    with Engine(str(wide_dir), dtype="bfloat16", device="cpu", disable_tqdm=True,
                enable_deterministic_inference=True) as engine:
        layers = [m for m in engine.core.scheduler.runner.model_runner.model.modules()
                  if isinstance(m, Linear)]
        assert all(hasattr(m, "pairs") for m in layers)
    assert _runs(wide_dir, prompts, "bfloat16", **SETTINGS["chunked"]) == want
    # the GEMM's tiles on for long steps (as a quantized model's route leaves them on AMX):
    # the mode turns them off, its tokens unchanged
    if 1 in tile_modes_here():
        with tiles_mode(1, set_gemm_tiles):
            assert _runs(wide_dir, prompts, "bfloat16", **SETTINGS["chunked"]) == want


@needs_kernels
def test_its_kv_is_not_shared_with_default_servers(wide_dir: Path) -> None:
    """The K/V a deterministic runner computes has other bits than a default one's: the KV
    tier and P/D transfers key them apart, so neither takes the other's for its own."""
    from banyan.engine.build import kv_identity
    from banyan.runner.model_runner import ModelRunner

    ids = {kv_identity(ModelRunner(wide_dir, dtype="bfloat16", num_slots=64, max_rows=2,
                                   show_progress=False, batch_invariant=flag))
           for flag in (False, True)}
    assert len(ids) == 2


def test_clear_errors(llama_dir: Path) -> None:
    for bad in (dict(device="cuda"), dict(linear_kernel="torch")):
        with pytest.raises(ValueError, match="enable_deterministic_inference"):
            EngineArgs(model="m", enable_deterministic_inference=True, **bad)
    with pytest.raises(ValueError, match="cpu-native attention backend"):
        Engine(str(llama_dir), dtype="bfloat16", device="cpu", attention_backend="sdpa",
               enable_deterministic_inference=True, disable_tqdm=True)
