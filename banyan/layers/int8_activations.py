"""`--activation-quant int8`: the quantized linears (int8 / int4 at load, a GGUF file's blocks)
computed with 8-bit activations, as llama.cpp computes them.

Off by default: the float32-activation kernels give exactly the float32 product of the
dequantized weights (token-exact against transformers), while this mode quantizes each step's
activation rows to int8 with a float32 scale per block of 32 inputs and multiplies them by
integer dot products (kernels/cpu_int8act_linear.cpp), which on AVX2 does 4x the multiply-adds
an instruction. Its outputs move by the activations' rounding (docs/performance.md gives the
perplexity).

A converted layer's method becomes `Int8ActivationMethod`, wrapping the weight method it had:
every step (the native layer stack's too) runs the new kernels on the codes repacked here at
load into their layout (8-row half panels, 4 inputs per 32-bit lane), which replaces the float
kernels' panels. Prefill-sized steps take the kernels as well: on Zen 3 they beat the float
path's dequantized slabs into torch's GEMM at every size measured (128 to 2,048 rows,
docs/performance.md).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from banyan.args import ACTIVATION_QUANT_CHOICES  # (int8_tiles: layers/int8_tiles.py)
from banyan.kernels import native
from banyan.layers.gguf_linear import GroupInt8Method
from banyan.layers.linear import Linear, NativeLinear
from banyan.layers.panels import PANEL, from_panels
from banyan.layers.quant import Int4Method, Int8Method, _QuantMethod

logger = logging.getLogger(__name__)

BLOCK = 32  # activation inputs per float32 scale
HALF = PANEL // 2  # rows of the kernels' half panels
WEIGHT_FORMATS = ("int8", "int4", "gguf")
# banyan_q8_linear_bf16's kind numbers (cpu_int8act_linear.cpp)
BF16_KINDS = ("int4", "int4_wide", "int8", "int5")


def check_activation_quant(mode: str, quantization: str,
                           device: torch.device = torch.device("cpu")) -> None:
    """ValueError at startup unless the mode can run on these weights (quantization as
    resolved: auto already made gguf or none) and this device (its kernels are CPU ones)."""
    if mode not in ACTIVATION_QUANT_CHOICES:
        raise ValueError(f"--activation-quant must be one of "
                         f"{', '.join(ACTIVATION_QUANT_CHOICES)}, "
                         f"got {mode!r}")
    if mode != "none" and device.type != "cpu":
        raise ValueError(f"--activation-quant {mode} runs on CPU only (its kernels are CPU "
                         f"kernels); this engine is on {device.type}")
    if mode == "int8_tiles" and quantization != "int8":
        raise ValueError(f"--activation-quant int8_tiles runs int8 weights with a scale per row: "
                         f"it needs --quantization int8, not {quantization!r}")
    if mode != "none" and quantization not in WEIGHT_FORMATS:
        raise ValueError(f"--activation-quant {mode} runs the quantized linear kernels: it "
                         f"needs --quantization int8, int4 or gguf (a GGUF model), not "
                         f"{quantization!r}")


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [rows (multiple of 16), K] in 0..15 -> the kernel's int4 half panels:
    [rows / 8, K / 32, 4, 8, 4] bytes; byte (j, row, i) of a block holds input 8j + i in its
    low nibble and 8j + 4 + i in its high one."""
    rows, k = codes.shape
    c = codes.reshape(rows // HALF, HALF, k // BLOCK, 4, 2, 4)
    pairs = c[..., 0, :] | (c[..., 1, :] << 4)  # [units, row, block, j, i]
    return pairs.permute(0, 2, 3, 1, 4).contiguous()


def pack_int8(codes: torch.Tensor, unit: int = HALF) -> torch.Tensor:
    """codes int8 [rows (multiple of 16), K] -> [rows / unit, K / 4, unit, 4]: for each 4
    inputs, the unit's rows' 4 codes side by side (8-row half panels here; int8_tiles' 16-row
    B-tile panels)."""
    rows, k = codes.shape
    return codes.reshape(rows // unit, unit, k // 4, 4).permute(0, 2, 1, 3).contiguous()


def pack_int5(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [rows (multiple of 16), K] in 0..31 -> one buffer: pack_int4 of the low
    nibbles, then the fifth bits, 32 bytes per half panel and block: bit 2j + s of byte
    (row, i) for input 8j + 4s + i."""
    rows, k = codes.shape
    high = (codes >> 4).reshape(rows // HALF, HALF, k // BLOCK, 4, 2, 4).to(torch.int32)
    shifts = torch.arange(8, dtype=torch.int32).reshape(4, 2, 1)  # bit 2j + s
    bits = (high << shifts).sum(dim=(3, 4)).to(torch.uint8)  # [units, row, block, i]
    return torch.cat([pack_int4(codes & 0xF).flatten(), bits.permute(0, 2, 1, 3).flatten()])


def unpack_int4(layer: Linear) -> torch.Tensor:
    """The float kernels' int4 panels -> codes uint8 [padded rows, K]."""
    pairs = from_panels(layer.codes, layer.codes.shape[0] * PANEL)
    return torch.stack([pairs & 0xF, pairs >> 4], dim=-1).reshape(pairs.shape[0], -1)


def unpack_q8_layout(packed: torch.Tensor, kind: str, rows: int, k: int) -> torch.Tensor:
    """pack_int4 / pack_int5 / pack_int8 undone -> codes [rows (padded), K]."""
    if kind == "int5":
        nibbles = packed[: rows * k // 2].reshape(rows // HALF, k // BLOCK, 4, HALF, 4)
        bits = packed[rows * k // 2:].reshape(rows // HALF, k // BLOCK, HALF, 1, 1, 4)
        shifts = torch.arange(8, dtype=torch.uint8).reshape(4, 2, 1)
        high = ((bits >> shifts) & 1).permute(0, 2, 1, 3, 4, 5).reshape(rows, k)
        return unpack_q8_layout(nibbles, "int4", rows, k) | (high << 4)
    if kind.startswith("int4"):
        units, blocks = packed.shape[:2]
        rows = packed.permute(0, 3, 1, 2, 4)  # [units, row, block, j, i]
        both = torch.stack([rows & 0xF, rows >> 4], dim=-2)  # [..., j, lo/hi, i]
        return both.reshape(units * HALF, blocks * 32)
    quads = packed.shape[1]  # (any unit of rows: pack_int8's)
    return packed.permute(0, 2, 1, 3).reshape(-1, quads * 4)


class Int8ActivationMethod(_QuantMethod):
    """A quantized layer computed with int8 activations (module)."""

    def __init__(self, inner: _QuantMethod, layer: Linear) -> None:
        self.inner = inner
        k = layer.in_features
        if k % BLOCK:
            raise ValueError(f"--activation-quant int8 quantizes activations per {BLOCK} "
                             f"inputs; a {type(inner).__name__} layer has {k}")
        if isinstance(inner, Int4Method):
            self.kind = "int4_wide" if layer.scale.dtype == torch.float32 else "int4"
            self.group = inner.group
            packed = pack_int4(unpack_int4(layer))
            self.mins: torch.Tensor | None = layer.mins
            if self.kind == "int4" and torch.equal(layer.mins.float(), layer.scale.float() * -8):
                self.mins = None  # GGUF's Q4_0: the kernels take -8 d, not read from memory
        elif isinstance(inner, GroupInt8Method) and self._five_bits(layer, inner.group):
            # Q5_0 (codes -16..15, float16 d): 5-bit codes q + 16 with min -16 d (exact), 0.75
            # bytes a weight instead of 1.25 as int8 (a Q4_K_M file's most common type)
            self.kind, self.group = "int5", BLOCK
            codes = from_panels(layer.codes, layer.codes.shape[0] * PANEL)
            packed = pack_int5((codes.to(torch.int16) + 16).to(torch.uint8))
            self.mins = None  # -16 d, taken by the kernels from d
            layer.scale = layer.scale.half()
        elif isinstance(inner, (Int8Method, GroupInt8Method)):
            self.kind = "int8"
            # a scale per row is one group of K inputs: [panels * 16] is [panels, 1, 16]
            self.group = k if isinstance(inner, Int8Method) else inner.group
            if self.group % BLOCK and BLOCK % self.group:
                raise ValueError(f"--activation-quant int8: int8 groups of {self.group} "
                                 f"inputs neither divide nor are a multiple of {BLOCK}")
            packed = pack_int8(from_panels(layer.codes, layer.codes.shape[0] * PANEL))
            self.mins = None
        else:
            raise ValueError(f"--activation-quant int8 has no kernel for {type(inner).__name__}")
        self.scale = layer.scale
        self.padded_rows = layer.codes.shape[0] * PANEL
        del layer.codes  # the new layout replaces the float kernels' (one copy in memory)
        layer.q8_codes = packed

    @staticmethod
    def _five_bits(layer: Linear, group: int) -> bool:
        """int8 codes of 32-input groups that all fit 5 bits (-16..15) with float16 scales
        (GGUF's Q5_0): then d and -16 d are exact in float16."""
        return (group == BLOCK and bool(((layer.codes >= -16) & (layer.codes <= 15)).all())
                and torch.equal(layer.scale.half().float(), layer.scale)
                and bool((layer.scale.abs() <= 2048).all()))

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16:  # bf16 in and out, as the layer stack runs it
            flat = x.reshape(-1, layer.in_features).contiguous()
            out = torch.empty(flat.shape[0], layer.out_features, dtype=torch.bfloat16)
            with native.kernel_range("banyan::q8_linear"):
                self._lib().banyan_q8_linear_bf16(
                    BF16_KINDS.index(self.kind), flat.data_ptr(), flat.shape[0],
                    layer.in_features, self.group, layer.q8_codes.data_ptr(),
                    self.scale.data_ptr(), None if self.mins is None else self.mins.data_ptr(),
                    self._bias_ptr(layer), out.data_ptr(), layer.out_features,
                    torch.get_num_threads())
            return out.reshape(*x.shape[:-1], layer.out_features)
        plain = x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous()
        flat = x if plain else x.reshape(-1, layer.in_features).to(torch.float32).contiguous()
        out = torch.empty(flat.shape[0], layer.out_features)
        with native.kernel_range("banyan::q8_linear"):
            self._kernel(layer, flat, out)
        return out if plain else out.to(x.dtype).reshape(*x.shape[:-1], layer.out_features)

    def _kernel(self, layer: Linear, flat: torch.Tensor, out: torch.Tensor) -> None:
        """out [T, N] float32 = flat [T, K] float32 (quantized inside) x the weight + bias."""
        lib = self._lib()
        bias = self._bias_ptr(layer)
        t, k, n = flat.shape[0], layer.in_features, layer.out_features
        threads = torch.get_num_threads()
        if self.kind == "int8":
            lib.banyan_q8_int8_linear_f32(flat.data_ptr(), t, k, self.group,
                                          layer.q8_codes.data_ptr(), self.scale.data_ptr(), bias,
                                          out.data_ptr(), n, threads)
            return
        mins = None if self.mins is None else self.mins.data_ptr()  # None: -8 d / -16 d
        if self.kind == "int5":
            lib.banyan_q8_int5_linear_f32(flat.data_ptr(), t, k, layer.q8_codes.data_ptr(),
                                          self.scale.data_ptr(), mins, bias, out.data_ptr(), n,
                                          threads)
            return
        fn = lib.banyan_q8_int4s_linear_f32 if self.kind == "int4_wide" else \
            lib.banyan_q8_int4_linear_f32
        fn(flat.data_ptr(), t, k, self.group, layer.q8_codes.data_ptr(), self.scale.data_ptr(),
           mins, bias, out.data_ptr(), n, threads)

    def native(self, layer: Linear) -> NativeLinear:
        return NativeLinear("q8_" + self.kind, layer.q8_codes, self.scale, self.mins,
                            self.group)

    def weight_bytes(self, layer: Linear) -> int:
        if self.kind == "int5":  # 5 bits and a float16 scale per 32 inputs
            return layer.out_features * (layer.in_features * 5 // 8 + layer.in_features // 16)
        own = self.inner.weight_bytes(layer)  # the same codes and scales, in another order
        if self.mins is None and self.kind == "int4":  # (Q4_0: no minimums read)
            own -= layer.out_features * (layer.in_features // self.group) * 2
        return own

    def dequantized_weight(self, layer: Linear) -> torch.Tensor:
        """The values the layer computes with, as the wrapped method gave them (float32)."""
        n = layer.out_features
        codes = unpack_q8_layout(layer.q8_codes, self.kind, self.padded_rows,
                                 layer.in_features)[:n].float()
        panels = self.scale.numel() // (PANEL * (layer.in_features // self.group))
        scale = from_panels(self.scale.reshape(panels, -1, PANEL), n).float()
        if self.kind == "int5":
            codes -= 16  # q d + (-16 d) = (q - 16) d, as the wrapped method computes it
        value = codes * scale.repeat_interleave(self.group, dim=1)
        if self.kind == "int5" or self.kind == "int8":
            return value
        low = (from_panels(self.mins, n).float() if self.mins is not None
               else scale * -8)  # Q4_0's implied minimum
        return value + low.repeat_interleave(self.group, dim=1)


def enable_int8_activations(model: nn.Module) -> int:
    """Wrap every quantized Linear of `model` (a tied head's copy too) -> how many; ValueError
    when there is none (nothing would change: the flag would be a silent no-op)."""
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and isinstance(module.method, _QuantMethod) and \
                not isinstance(module.method, Int8ActivationMethod):
            module.method = Int8ActivationMethod(module.method, module)
            count += 1
    if count == 0:
        raise ValueError("--activation-quant int8: this model has no quantized linear layer "
                         "(--quantization int8, int4 or gguf with Q4/Q5/Q6/Q8 blocks)")
    logger.info("%d quantized linear layers compute with int8 activations", count)
    return count
