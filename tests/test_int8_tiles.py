"""--activation-quant int8_tiles (layers/int8_tiles.py, kernels/cpu_int8_tiles.cpp): int8
weights with a scale per row times int8 activations with a scale per 128 inputs, exact integer
sums folded in one float order, on AMX-INT8 tiles or emulated."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from banyan import Engine, SamplingParams
from banyan.args import EngineArgs
from banyan.kernels import native
from banyan.layers.int8_activations import check_activation_quant
from banyan.layers.int8_tiles import (BLOCK, Int8TilesMethod, enable_int8_tiles, pack_tiles,
                                      tiles_here, unpack_tiles)
from banyan.layers.linear import Linear
from banyan.layers.quant import Int4Method, Int8Method
from tests.model_helpers import make_runner, random_ids

pytestmark = pytest.mark.skipif(tiles_here() == 0, reason="int8 tile kernel not built here")


def _layer(out_f: int, in_f: int, seed: int, bias: bool = True) -> Linear:
    g = torch.Generator().manual_seed(seed)
    layer = Linear(in_f, out_f, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_f, in_f, generator=g) * 0.05)
        if bias:
            layer.bias.copy_(torch.randn(out_f, generator=g))
    layer.convert(Int8Method())
    enable_int8_tiles(layer)
    return layer


def _x(tokens: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(seed))
    x[:, 3] *= 40.0  # an outlier channel: its block's scale, not the others'
    if tokens > 2:
        x[1, :BLOCK] = 0.0  # a zero block: scale 0, codes 0
    return x


def _quantized(x: torch.Tensor) -> torch.Tensor:
    """The activations the kernel multiplies (its own quantization), as float64."""
    t, k = x.shape
    blocks = (k + BLOCK - 1) // BLOCK
    q, d = torch.empty(t, k, dtype=torch.int8), torch.empty(t, blocks)
    native.load().banyan_int8_tiles_quantize_f32(x.data_ptr(), t, k, q.data_ptr(), d.data_ptr())
    scale = d.double().repeat_interleave(BLOCK, dim=1)[:, :k]
    assert ((q.double() * scale - x.double()).abs() <= scale / 2 + 1e-6).all()
    assert (q.abs() <= 127).all()
    return q.double() * scale


@pytest.mark.parametrize("out_f,in_f,tokens", [(50, 64, 1), (100, 128, 5), (48, 192, 16),
                                               (33, 320, 17), (64, 448, 33), (40, 576, 70)])
def test_kernel_matches_float64_of_the_quantized_activations(out_f: int, in_f: int,
                                                             tokens: int) -> None:
    """Blocks of 128 and a shorter last one (320 = 2 x 128 + 64), a last panel alone or in a
    pair, token counts around the 16-row tiles."""
    layer = _layer(out_f, in_f, out_f + in_f)
    x = _x(tokens, in_f, tokens)
    want = _quantized(x) @ layer.method.dequantized_weight(layer).double().T
    want += layer.bias.double()
    got = layer(x)
    assert got.dtype == torch.float32
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


def test_each_token_gets_the_bits_it_gets_alone_and_bf16_is_the_rounding() -> None:
    layer = _layer(80, 320, 3)
    x = _x(37, 320, 4)
    whole = layer(x)
    for t in range(37):
        assert torch.equal(whole[t:t + 1], layer(x[t:t + 1]))
    xb = x.bfloat16()
    assert torch.equal(layer(xb), layer(xb.float()).bfloat16())


@pytest.mark.skipif(tiles_here() < 2, reason="neither AMX-INT8 nor AVX512-VNNI here")
def test_the_fast_paths_and_the_emulated_tiles_give_the_same_bits() -> None:
    """AMX's tiles (steps of 8 tokens or more) and the vpdpbusd path (shorter ones; all of them
    without AMX) against the tiles emulated in plain loops."""
    layer = _layer(72, 448, 5)
    lib = native.load()
    for tokens in (1, 3, 7, 8, 15, 16, 40, 70):
        x = _x(tokens, 448, tokens)
        outs = []
        for amx in (1, 0):
            out = torch.empty(tokens, 72)
            lib.banyan_int8_tiles_linear_f32(x.data_ptr(), tokens, 448,
                                             layer.tile_codes.data_ptr(),
                                             layer.scale.data_ptr(), layer.bias.data_ptr(),
                                             out.data_ptr(), 72, amx, 2)
            outs.append(out)
        assert torch.equal(*outs)


def test_packing_round_trips_and_keeps_the_weights() -> None:
    codes = torch.randint(-127, 128, (32, 128), dtype=torch.int8)
    assert torch.equal(unpack_tiles(pack_tiles(codes)), codes)
    dense = Linear(128, 20, bias=False)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(20, 128, generator=torch.Generator().manual_seed(9)))
    dense.convert(Int8Method())
    before = dense.method.dequantized_weight(dense)
    enable_int8_tiles(dense)
    assert isinstance(dense.method, Int8TilesMethod)
    assert torch.equal(dense.method.dequantized_weight(dense), before)
    assert not hasattr(dense, "codes")  # one copy of the codes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stack_runs_the_tiles_as_the_per_op_path_does(model_dirs: dict[str, Path],
                                                      dtype: str) -> None:
    from tests.test_native_stack import _check_steps

    runner = make_runner(model_dirs["qwen2"], dtype=dtype, quantization="int8",
                         activation_quant="int8_tiles")
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.method, Int8TilesMethod) for m in linears)
    assert runner.stack is not None
    _check_steps(runner)


def test_engine_makes_text_and_bad_flags_are_refused(model_dirs: dict[str, Path]) -> None:
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    with Engine(str(model_dirs["llama"]), dtype="float32", device="cpu", disable_tqdm=True,
                quantization="int8", activation_quant="int8_tiles") as engine:
        prompts = [random_ids(12, 3), random_ids(30, 4)]
        both = engine.generate(input_ids=prompts, sampling_params=[params] * 2)
        alone = engine.generate(input_ids=prompts[:1], sampling_params=[params])
    assert len(both[0].output_ids) == 8
    assert both[0].output_ids == alone[0].output_ids  # its company changes no token
    with pytest.raises(ValueError, match="int8_tiles .* needs --quantization int8"):
        check_activation_quant("int8_tiles", "int4")
    with pytest.raises(ValueError, match="activation_quant must be one of"):
        EngineArgs(activation_quant="int4_tiles")
    int4 = Linear(64, 16)
    with torch.no_grad():
        int4.weight.copy_(torch.randn(16, 64, generator=torch.Generator().manual_seed(8)))
    int4.convert(Int4Method(32))
    with pytest.raises(ValueError, match="int8_tiles: this model has no int8"):
        enable_int8_tiles(int4)
