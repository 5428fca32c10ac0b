"""The bf16 GEMM of quantized (and plain bf16) weights with its products on tiles
(kernels/cpu_quant_gemm_tiles.h): emulated in memory wherever the tile paths are built
(AVX512-BF16), AMX's own where the CPU grants them. Against a float64 product of the weights
it multiplies (rounded to bf16; int8 rows' codes, each sum then scaled); a token's outputs the
same whatever block of 32 it falls in; quantized weights' steps shorter than
BF16_GEMM_MIN_TOKENS untouched by the mode, dense pairs' on the tiles at every step."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from banyan.attention.decode_tiles import ASK, tile_modes_here, tiles_mode
from banyan.kernels import native
from banyan.layers.gemm_tiles import PAIRS_TILES_FROM, gemm_tiles_agree, set_gemm_tiles
from banyan.layers.panels import pack_bf16_pairs
from banyan.layers.quant import BF16_GEMM_MIN_TOKENS
from tests.test_quant import _gemm_weight, _quantized_layer

MODES = tile_modes_here() if native.load() is not None and native.bf16_gemm_here() else []
pytestmark = pytest.mark.skipif(not MODES, reason="no tile path in this build (AVX512-BF16)")


@pytest.fixture(params=MODES, ids=lambda m: {1: "emulated", 2: "amx"}[m])
def tile_mode(request: pytest.FixtureRequest) -> Iterator[int]:
    with tiles_mode(request.param, set_gemm_tiles):
        yield request.param


def _gemm(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return layer.method._bf16_gemm(layer, x)


@pytest.mark.parametrize("method", ["int8", "int4g32", "int4g128", "int8g32",
                                    "int4-float32-scales"])
@pytest.mark.parametrize("out_f,in_f,tokens,bias", [(70, 128, 17, True), (49, 96, 33, False),
                                                    (100, 576, 64, True), (16, 256, 40, False),
                                                    (300, 256, 23, True)])
def test_tile_gemm_matches_float64_of_the_weights_it_multiplies(tile_mode: int, method: str,
                                                                out_f: int, in_f: int,
                                                                tokens: int, bias: bool) -> None:
    """Every panel pair (and a group's odd last panel), blocks of 32 tokens and a last block of
    up to 16 or of 17-31 (padded), rows not a multiple of 16, several groups a thread."""
    if method == "int4g128" and in_f % 128:
        pytest.skip("groups of 128 inputs")
    torch.manual_seed(out_f + in_f + tokens)
    layer = _quantized_layer(method, out_f, in_f, bias)
    x = torch.randn(tokens, in_f).bfloat16()
    want = x.double() @ _gemm_weight(layer, method).T + (layer.bias.double() if bias else 0.0)
    got = _gemm(layer, x)
    tol = 2**-8 * want.abs() + 1e-4 * want.abs().max()
    assert ((got.double() - want).abs() <= tol).all()


def test_a_token_has_its_bits_in_any_block_of_the_step(tile_mode: int) -> None:
    """A token's outputs on tiles depend on its inputs alone: the same in a step of 17, of 40
    (a padded last block) or of 70 tokens, at any row of a tile."""
    torch.manual_seed(5)
    layer = _quantized_layer("int4g32", 80, 192, True)
    x = torch.randn(70, 192).bfloat16()
    whole = _gemm(layer, x)
    assert torch.equal(_gemm(layer, x[:17]), whole[:17])
    assert torch.equal(_gemm(layer, x[13:53]), whole[13:53])


def test_steps_short_of_the_gemm_keep_their_kernel(tile_mode: int) -> None:
    """Steps under BF16_GEMM_MIN_TOKENS (decodes, speculative checks) never take the tiles:
    the same bits as with the mode off, so speculation and batching change no output."""
    torch.manual_seed(7)
    layer = _quantized_layer("int8", 70, 256, True)
    x = torch.randn(BF16_GEMM_MIN_TOKENS - 1, 256).bfloat16()
    with torch.inference_mode():
        got = layer(x)
        with tiles_mode(0, set_gemm_tiles):
            assert torch.equal(layer(x), got)


def test_dense_pairs_on_tiles_at_every_step(tile_mode: int) -> None:
    """A dense bf16 weight stored in the GEMM's pairs (read in place, not dequantized) on the
    tiles at every step (PAIRS_TILES_FROM): against float64, and a token's outputs the same
    alone (a decode: tiles of one row), in a short check, in a block of 16, in a padded last
    block and in a long step, so a step's size changes no token's bits."""
    assert PAIRS_TILES_FROM == 1
    torch.manual_seed(9)
    weight = torch.randn(50, 128).bfloat16()
    x = torch.randn(BF16_GEMM_MIN_TOKENS + 40, 128).bfloat16()
    pairs = pack_bf16_pairs(weight)
    got = native.bf16_pairs_gemm(x, pairs, 50)
    want = x.double() @ weight.double().T
    assert ((got.double() - want).abs() <= 2**-8 * want.abs() + 1e-4 * want.abs().max()).all()
    for t0, t in ((0, 1), (7, 1), (3, 5), (0, 13), (16, 16), (5, 20), (0, 33)):
        assert torch.equal(native.bf16_pairs_gemm(x[t0:t0 + t].contiguous(), pairs, 50),
                           got[t0:t0 + t]), (t0, t)


def test_the_emulated_tiles_are_the_path_taken() -> None:
    """Sums whose order shows. Tiles emulated as the SDM defines tdpbf16ps sum the even inputs'
    products and the odd inputs' apart, then add the two: for (2^24, 0, 1, -2^24) the even sum
    2^24 + 1 rounds back to 2^24, and the odd one cancels it (0), where vdpbf16ps, a pair at a
    time, ends at 1; for (1, 2^24, 1, -2^24) the even sum is 2 and the odd one 0 (2), where a
    pair at a time ends at 0 or 1. Bit-level differences of ordinary sums mostly vanish in the
    outputs' rounding to bf16."""
    if 1 not in MODES:
        pytest.skip("no emulated tiles")
    weight = torch.zeros(16, 32)
    weight[0, :4] = torch.tensor([2.0**24, 0.0, 1.0, -2.0**24])
    weight[1, :4] = torch.tensor([1.0, 2.0**24, 1.0, -2.0**24])
    pairs = pack_bf16_pairs(weight.bfloat16())
    x = torch.ones(BF16_GEMM_MIN_TOKENS, 32).bfloat16()
    with tiles_mode(1, set_gemm_tiles):
        tiles = native.bf16_pairs_gemm(x, pairs, 16)[:, :2]
    with tiles_mode(0, set_gemm_tiles):  # (the process's mode may be AMX's tiles: the route's)
        vector = native.bf16_pairs_gemm(x, pairs, 16)[:, :2]
    assert (tiles[:, 0] == 0).all() and (vector[:, 0] == 1).all()
    assert (tiles[:, 1] == 2).all() and (vector[:, 1] != 2).all()


def test_the_emulated_tiles_read_and_leave_no_denormals() -> None:
    """tdpbf16ps takes denormal inputs as zero and flushes denormal results (DAZ = FTZ = 1,
    whatever MXCSR says), and so do the emulated tiles: a denormal input times 2^100 is 0 (2^-33
    otherwise), and so is 2^-70 x 2^-70 (2^-140, a denormal float32)."""
    if 1 not in MODES:
        pytest.skip("no emulated tiles")
    tiny = torch.tensor([0x0001], dtype=torch.int16).view(torch.bfloat16)  # 2^-133
    weight = torch.zeros(16, 32).bfloat16()
    weight[0, 0], weight[1, 0] = 2.0**100, 2.0**-70
    x = torch.ones(BF16_GEMM_MIN_TOKENS, 32).bfloat16()
    x[:, 0] = tiny
    x[1::2, 0] = 2.0**-70
    with tiles_mode(1, set_gemm_tiles):
        tiles = native.bf16_pairs_gemm(x, pack_bf16_pairs(weight), 16)[:, :2].float()
    assert (tiles[::2, 0] == 0).all() and (tiles[1::2, 1] == 0).all()
    assert (tiles[1::2, 0] == 2.0**30).all()  # (2^-70 x 2^100: nothing flushed)
    assert torch.tensor(2.0**-140).item() != 0  # (float32 itself keeps it)


def test_the_start_up_check_passes_on_the_tiles_in_use(tile_mode: int) -> None:
    """What the route asks of an AMX CPU's tiles (layers/gemm_tiles.py), of the tiles here."""
    assert gemm_tiles_agree(mode=tile_mode)


def test_the_start_up_check_reads_a_dense_decode_on_the_tiles(
        tile_mode: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check covers what a dense model runs on the tiles at every step: a dense layer's
    one-token step planted off (on the tiles only) fails it."""
    real = native.bf16_pairs_gemm

    def off_on_tiles(x: torch.Tensor, *args: object) -> torch.Tensor:
        out = real(x, *args)
        return out + 1 if x.shape[0] == 1 and set_gemm_tiles(ASK) != 0 else out

    monkeypatch.setattr(native, "bf16_pairs_gemm", off_on_tiles)
    assert not gemm_tiles_agree(mode=tile_mode)


def test_amx_tiles_are_refused_where_the_cpu_has_none() -> None:
    with tiles_mode(0, set_gemm_tiles):
        assert set_gemm_tiles(2) == (2 if native.prefill_tiles() == 2 else 0)
        assert set_gemm_tiles(7) == set_gemm_tiles(ASK)
