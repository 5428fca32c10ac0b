"""`--activation-quant int8_tiles`: int8 weights (`--quantization int8`, a scale per output row)
times int8 activations with a scale per 128 inputs of each token, the integer products on
AMX-INT8 tiles (kernels/cpu_int8_tiles.cpp).

Why: on an AMX Xeon a batched step's projections are bound by the tiles, and weight-only int8
runs the same bf16 tile products as bf16 after dequantizing each panel, so it loses to bf16
there (#16's random 64: 0.79-0.85x). tdpbssd takes twice the inputs an instruction, on the
codes as stored.

The block of 128 inputs is the measured compromise. Perplexity of the fixed text over the
float32 model's (22.765; `banyan bench quality`, chunks of 256 / 512): int8 weights alone
+0.35%; with activation scales per 64 inputs +0.55% / +0.78%, per 128 +1.33% / +1.35%, per 192
+1.77% / +1.48% (+1.5% is #16's bound for int8), per token +3.7% (simulated in transformers:
the activations' outlier channels). Per 64, the fold of the int32 sums after every tile product
left the kernel no faster than bf16's tiles (1.05x the time); per 128 and 192 it runs SmolLM2's
projections at 64 tokens in 0.87-0.89x / 0.87-1.01x bf16's time, where weight-only int8 takes
1.22-1.28x (the Xeon of #13, alternating, 30 s a round; docs/performance.md).

Every step, whatever its size: a token's integer sums are exact and folded in one order, so its
outputs do not depend on its company (batching, speculation) nor on the CPU: steps of fewer
than 8 tokens (and every step on CPUs with AVX512-VNNI but no AMX-INT8, as Zen 4) take a
vpdpbusd path with the same integer sums, faster there than a tile's 16 rows used by 1-4
(SmolLM2's projections from memory, the Xeon of #13: 1 token 0.67-0.93x the tiles' time, 4
tokens 0.64-0.79x); without either the tiles run in plain loops (a warning at start-up).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from banyan.kernels import native
from banyan.layers.int8_activations import pack_int8, unpack_q8_layout
from banyan.layers.linear import Linear, NativeLinear
from banyan.layers.panels import PANEL, from_panels
from banyan.layers.quant import Int8Method, _QuantMethod

logger = logging.getLogger(__name__)

STEP = 64  # inputs a tile product takes: K must be a multiple
_ENTRIES = {torch.bfloat16: "banyan_int8_tiles_linear_bf16",  # the kernel's entry per x dtype
            torch.float32: "banyan_int8_tiles_linear_f32"}
BLOCK = 128  # activation inputs per scale (kernels/cpu_int8_tiles.cpp: kBlock)


def pack_tiles(codes: torch.Tensor) -> torch.Tensor:
    """codes int8 [rows (multiple of 16), K] -> [rows / 16, K / 4, 16, 4]: per panel of 16 rows,
    for each 4 inputs the 16 rows' 4 codes side by side (a tdpbssd B tile per 64 inputs)."""
    return pack_int8(codes, PANEL)


def unpack_tiles(packed: torch.Tensor) -> torch.Tensor:
    """pack_tiles undone -> codes [rows (padded), K]."""
    return unpack_q8_layout(packed, "int8", packed.shape[0] * PANEL, packed.shape[1] * 4)


def tiles_here() -> int:
    """3 where the kernel runs AMX-INT8's tiles (and vpdpbusd for steps under 8 tokens), 2
    vpdpbusd alone (AVX512-VNNI without AMX), 1 only the tiles emulated in plain loops, 0 not
    built (no AVX-512 or not x86-64 Linux)."""
    lib = native.load()
    return 0 if lib is None else int(lib.banyan_int8_tiles_here())


class Int8TilesMethod(_QuantMethod):
    """An int8 layer computed with int8 activations on int8 tiles (module)."""

    def __init__(self, inner: _QuantMethod, layer: Linear) -> None:
        if not isinstance(inner, Int8Method):
            raise ValueError("--activation-quant int8_tiles runs int8 weights with a scale per "
                             f"row (--quantization int8), not {type(inner).__name__}")
        if layer.in_features % STEP:
            raise ValueError(f"--activation-quant int8_tiles needs layers of a multiple of "
                             f"{STEP} inputs; one has {layer.in_features}")
        self.inner = inner
        layer.tile_codes = pack_tiles(from_panels(layer.codes, layer.codes.shape[0] * PANEL))
        del layer.codes  # the new layout replaces the float kernels' (one copy in memory)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        # (as few torch calls as will do: at 64 tokens each layer's Python side cost ~20 us
        # more than the dense bf16 method's, ~0.2x a SmolLM2 projection's kernel time)
        plain = x.dim() == 2 and x.dtype in _ENTRIES
        flat = x.contiguous() if plain else x.reshape(-1, layer.in_features).float().contiguous()
        out = flat.new_empty((flat.shape[0], layer.out_features))
        with native.kernel_range("banyan::int8_tiles_linear"):
            getattr(self._lib(), _ENTRIES[flat.dtype])(
                flat.data_ptr(), flat.shape[0], layer.in_features, layer.tile_codes.data_ptr(),
                layer.scale.data_ptr(), self._bias_ptr(layer), out.data_ptr(),
                layer.out_features, 1, torch.get_num_threads())
        return out if plain else out.to(x.dtype).reshape(*x.shape[:-1], layer.out_features)

    def native(self, layer: Linear) -> NativeLinear:
        return NativeLinear("q8_tiles", layer.tile_codes, layer.scale)

    def weight_bytes(self, layer: Linear) -> int:
        return self.inner.weight_bytes(layer)  # the same codes and scales, in another order

    def dequantized_weight(self, layer: Linear) -> torch.Tensor:
        codes = unpack_tiles(layer.tile_codes)[: layer.out_features].float()
        return codes * layer.scale[: layer.out_features, None]


def enable_int8_tiles(model: nn.Module) -> int:
    """Convert every int8 Linear of `model` -> how many; ValueError when the kernels are not
    built here or the model has none."""
    here = tiles_here()
    if here == 0:
        raise ValueError("--activation-quant int8_tiles needs the native kernels built with "
                         "AVX-512 on x86-64 Linux")
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and isinstance(module.method, Int8Method):
            module.method = Int8TilesMethod(module.method, module)
            count += 1
    if count == 0:
        raise ValueError("--activation-quant int8_tiles: this model has no int8 linear layer "
                         "(it needs --quantization int8)")
    if here == 1:
        logger.warning("--activation-quant int8_tiles: this CPU has neither AMX-INT8 nor "
                       "AVX512-VNNI; the same integer sums run in plain loops, many times "
                       "slower (use int8 here)")
    logger.info("%d int8 linear layers compute with int8 activations on tiles", count)
    return count
