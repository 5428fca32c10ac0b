"""Weight-only int8 / int4 linears on CUDA (`--quantization int8|int4` there): the CPU methods'
formats, quantized the same way (layers/quant.py), in the row-major layout the Triton kernel
reads (kernels/triton_quant_linear.py), which dequantizes tiles in registers as the weights
stream in: a decode step reads 1 or ~0.6 bytes a weight instead of bf16's 2.

- int8: codes [out, in] int8 and a float32 scale per output row.
- int4: codes two a byte [out, in / 2] (input k even in the low nibble), a float16 scale and
  minimum per 32 inputs.

GGUF blocks stay CPU-only (`--quantization none` loads a GGUF model dense on CUDA). Checked
without a GPU through Triton's interpreter (tests/test_triton_quant_linear.py) and compiled for
sm_90 on the host (tests/test_triton_compile.py); not yet run or timed on a GPU.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

import torch

from banyan.layers.linear import Linear
from banyan.layers.quant import (INT4_GROUP_SIZES, WeightOnlyMethod, int4_values,
                                 quantize_int4, quantize_int8)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_cuda_quantization(quantization: str, dtype: torch.dtype) -> None:
    """ValueError at startup where CUDA cannot run the format (check_quantization's CUDA part)."""
    if quantization == "gguf":
        raise ValueError("--quantization gguf computes from a GGUF file's blocks on CPU only; "
                         "on CUDA load the model dense (--quantization none) or quantize it "
                         "(int8, int4)")
    if dtype not in DTYPES:
        raise ValueError(f"--quantization {quantization} on CUDA takes float32, bfloat16 or "
                         f"float16 activations, not {dtype}")
    if importlib.util.find_spec("triton") is None:
        raise ValueError(f"--quantization {quantization} on CUDA needs the triton package "
                         "(pip install triton)")


def _kernels() -> ModuleType:
    """Imported on first use: importing it decorates the kernel (for the interpreter or not)."""
    return importlib.import_module("banyan.kernels.triton_quant_linear")


def _rows(x: torch.Tensor, layer: Linear) -> torch.Tensor:
    flat = x.reshape(-1, layer.in_features)
    return flat if flat.stride(-1) == 1 else flat.contiguous()


class TritonInt8Method(WeightOnlyMethod):
    """int8 codes with one float32 scale per output row, each row's sum times its scale."""

    def adopt(self, layer: Linear) -> None:
        codes, scale = quantize_int8(self._take_dense(layer))
        layer.codes, layer.scale = codes.contiguous(), scale.contiguous()

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        out = _kernels().quant_linear(_rows(x, layer), layer.codes, layer.scale,
                                      bias=layer.bias)
        return out.reshape(*x.shape[:-1], layer.out_features)

    def weight_bytes(self, layer: Linear) -> int:
        return layer.out_features * (layer.in_features + 4)

    def dequantized_weight(self, layer: Linear) -> torch.Tensor:
        return layer.codes.float() * layer.scale[:, None]


class TritonInt4Method(WeightOnlyMethod):
    """4-bit codes with a float16 scale and minimum per group of `group` inputs."""

    def __init__(self, group: int = INT4_GROUP_SIZES[0]) -> None:
        if group not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group must be one of {INT4_GROUP_SIZES}, got {group}")
        self.group = group

    def adopt(self, layer: Linear) -> None:
        if layer.in_features % self.group:
            raise ValueError(f"int4 groups of {self.group} need in_features divisible by it, "
                             f"got {layer.in_features}")
        codes, scale, low = quantize_int4(self._take_dense(layer), self.group)
        layer.codes = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
        layer.scale, layer.mins = scale.contiguous(), low.contiguous()

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        out = _kernels().quant_linear(_rows(x, layer), layer.codes, layer.scale, layer.mins,
                                      self.group, layer.bias)
        return out.reshape(*x.shape[:-1], layer.out_features)

    def weight_bytes(self, layer: Linear) -> int:
        return layer.out_features * (layer.in_features // 2 + 4 * (layer.in_features // self.group))

    def dequantized_weight(self, layer: Linear) -> torch.Tensor:
        return int4_values(layer.codes, layer.scale, layer.mins, self.group)
