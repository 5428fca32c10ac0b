"""Whether a bf16 model's quantized layers multiply their long steps on AMX tiles
(kernels/cpu_quant_gemm_tiles.h): decided once, at start-up, on a CPU with AMX.

On an AMX Xeon a dense bf16 layer's long steps run oneDNN's GEMM on AMX tiles, while a quantized
layer's ran the vdpbf16ps kernel: int8 and int4 weights would lose to bf16 at batched decodes
and prefill chunks (#16's batched target). On tiles the kernel dequantizes its panels as before
and multiplies them by tdpbf16ps. Quantized weights: steps of BF16_GEMM_MIN_TOKENS tokens or
more only (the shorter ones keep the bits a token gets alone from the short kernels); a dense
bf16 weight in pairs: every step (PAIRS_TILES_FROM); one mode a process.

Taken only once measured, as the attention kernels' tiles are (attention/decode_tiles.py): the
real tiles' output must match the vector loop's on random weights and inputs (bf16 rounding
apart), then a 64-token step of an int4 and an int8 layer of SmolLM2's gate/up shape is timed
both ways, in turns, and tiles stay unless the vector loop measured clearly faster
(decode_tiles.keeps_tiles).
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

import torch

from banyan.attention.decode_tiles import ASK, keeps_tiles, tiles_mode
from banyan.attention.prefill_choice import alternating_medians
from banyan.kernels import native
from banyan.layers.linear import Linear, SkinnyBf16Method
from banyan.layers.quant import BF16_GEMM_MIN_TOKENS, Int4Method, Int8Method

logger = logging.getLogger(__name__)

PROBE_SHAPE = (1536, 576)  # (out, in): one half of SmolLM2's gate/up
PROBE_TOKENS = 64  # a batched decode step (random 64 x 128/128's)
# A dense bf16 weight in the GEMM's pairs takes the tiles at every step, decodes included
# (cpu_quant_gemm_tiles.h): its tiles shaped to a decode's one row cost what the vector loop
# does, and a step's size then never changes a token's bits, so speculative checks take the
# tiles too. The Xeon of #13 (family 6 model 207, 2026-12-06, SmolLM2's dense bf16 stack, one
# request over 256 tokens, 15 rounds alternating): 1 token 0.98x the vector loop's time, 4
# tokens 0.91x, 9 0.63x, 13 0.49x, 16 0.43x (docs/performance.md).
PAIRS_TILES_FROM = 1


def set_gemm_tiles(mode: int, lib: Any = None, pairs_from: int = PAIRS_TILES_FROM) -> int:
    """The bf16 GEMM's products for the whole process from now on: 0 vdpbf16ps, 1 tiles
    emulated in memory (tests), 2 AMX tiles (only where native.prefill_tiles() is 2); any other
    value only asks. On tiles, quantized weights' steps of BF16_GEMM_MIN_TOKENS tokens or more,
    dense pairs' of `pairs_from`. Returns the mode in effect (0 where the kernels have no tile
    path). lib: another build of the kernels (its entry typed as native.load() types it; the
    benchmarks' A/Bs), else the process's own."""
    lib = native.load() if lib is None else lib
    return 0 if lib is None else int(lib.banyan_set_gemm_tiles(mode, BF16_GEMM_MIN_TOKENS,
                                                               pairs_from))


def _probe_layers() -> list[Linear]:
    gen = torch.Generator().manual_seed(0)
    layers = []
    for method in (Int4Method(32), Int8Method()):
        layer = Linear.from_weight(torch.randn(*PROBE_SHAPE, generator=gen) * 0.05)
        layer.convert(method)
        layers.append(layer)
    return layers


def _outputs(layers: list[Linear], x: torch.Tensor, mode: int) -> list[torch.Tensor]:
    with tiles_mode(mode, set_gemm_tiles), torch.inference_mode():
        return [layer(x).float() for layer in layers]


def _dense_pairs_layer() -> Linear:
    """A dense bf16 layer in the GEMM's pairs (read in place on the tiles, at every step)."""
    weight = torch.randn(*PROBE_SHAPE, generator=torch.Generator().manual_seed(2)) * 0.05
    layer = Linear.from_weight(weight.bfloat16())
    layer.convert(SkinnyBf16Method())
    return layer


def gemm_tiles_agree(mode: int = 2) -> bool:
    """Whether the GEMM's output on tiles (`mode`) is the vector loop's on random weights and
    inputs, to within what the two paths' roundings allow: the probe's quantized layers and a
    dense one in pairs, at a batched step's tokens and (the dense one) at a decode's one."""
    layers = [*_probe_layers(), _dense_pairs_layer()]
    x = torch.randn(PROBE_TOKENS + 5, PROBE_SHAPE[1], generator=torch.Generator().manual_seed(1))
    for tokens in (x.bfloat16(), x[:1].bfloat16()):
        for want, got in zip(_outputs(layers, tokens, 0), _outputs(layers, tokens, mode),
                             strict=True):
            if not (bool(torch.isfinite(got).all()) and torch.allclose(
                    got, want, rtol=2**-6, atol=1e-2 * float(want.abs().max()))):
                return False
    return True


def time_gemm_paths(mode: int = 2, rounds: int = 5) -> tuple[float, float]:
    """Median seconds of a PROBE_TOKENS-token step through the probe layers, on the vector
    loop and in `mode` (in turns)."""
    layers = _probe_layers()
    x = torch.randn(PROBE_TOKENS, PROBE_SHAPE[1]).bfloat16()

    def step(m: int) -> None:
        with tiles_mode(m, set_gemm_tiles), torch.inference_mode():
            for layer in layers:
                layer(x)

    vector_s, tiles_s = alternating_medians([lambda: step(0), lambda: step(mode)], rounds)
    return vector_s, tiles_s


@cache
def gemm_tiles_route(dtype: torch.dtype) -> int:
    """The GEMM's mode for this process (module docstring) on a CPU with AMX and bf16
    activations, set and returned: 2 where the tiles check out and measure faster, else 0;
    elsewhere 0, the process's mode left as it is (the vector loop, or a test's emulated
    tiles)."""
    if not (native.amx_here() and native.prefill_tiles() == 2 and dtype == torch.bfloat16
            and set_gemm_tiles(ASK) == 0):
        return 0
    if not gemm_tiles_agree():
        logger.warning("bf16 GEMM on AMX tiles: output differs from the vector loop's, "
                       "not used")
        return set_gemm_tiles(0)
    vector_s, tiles_s = time_gemm_paths()
    mode = 2 if keeps_tiles(vector_s, tiles_s) else 0
    logger.info("bf16 GEMM on AMX tiles: checked; %d-token steps of an int4 and an int8 "
                "layer took %.2f ms on tiles, %.2f ms on the vector loop: %s", PROBE_TOKENS,
                tiles_s * 1e3, vector_s * 1e3,
                f"tiles in use (quantized weights from {BF16_GEMM_MIN_TOKENS} tokens, dense "
                f"pairs from {PAIRS_TILES_FROM})" if mode else "vector loop kept")
    return set_gemm_tiles(mode)
