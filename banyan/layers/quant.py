"""Weight-only quantized linear methods for CPU, made at load time from a loaded dense layer:
`Int8Method` (one scale per output row, symmetric) and `Int4Method` (a scale and a minimum per
group of inputs, 16 levels between them). Activations stay float; the kernels
(kernels/cpu_quant_linear.cpp) convert each weight to float32 as it streams from memory, so a
decode step reads 1 or ~0.6 byte per weight instead of 2 (bf16) or 4 (float32).

Packing (the kernel's layout): rows padded to a multiple of 16 and cut into panels of 16; in a
panel the 16 rows' weights for one input sit side by side. `dequantized_weight` gives back the
[out, in] float32 matrix a layer computes with, which is what the tests check the kernels
against (in float64) and what a torch reference model uses. A bf16 model's long steps on a
CPU with AVX512-BF16 compute with those values rounded once to bf16 (kernels/
cpu_quant_gemm_bf16.cpp), as a bf16 model's GEMM does with its weights. On CUDA the same
formats and values run through Triton (layers/quant_cuda.py); `quantized_method` picks by device.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch
from torch import nn

from banyan.kernels import native
from banyan.kernels.native import bf16_gemm_applies
from banyan.layers.linear import Linear, LinearMethod, NativeLinear
from banyan.layers.panels import PANEL, from_panels, pad_rows, to_panels

# Steps of at least this many tokens go through torch's GEMM on dequantized slabs of at most
# SLAB_BYTES (measured on Zen 3: the native kernels win below ~128 tokens, GEMM above).
DEQUANT_MIN_TOKENS = 128
SLAB_BYTES = 8 << 20
# A bf16 model's steps of at least this many tokens multiply bf16 activations by the weights
# dequantized to bf16 pairs in the kernel's own tiles (kernels/cpu_quant_gemm_bf16.cpp, on
# CPUs with AVX512-BF16): as fast as oneDNN on packed bf16 weights (SmolLM2's layer, Zen 5: 8
# tokens 0.16 vs 0.17 ms, 64 0.61 vs 0.63, 512 4.4 vs 4.4). Shorter steps take the short
# kernels (int4's bf16 one, the float32 ones on x widened), which compute with the weights'
# exact values where the GEMM rounds them to bf16: a speculative check of up to 16 tokens then
# gives each token the bits of its decode, so speculation changes no greedy output (from 9, the
# GEMM's bits had parted the two at near-ties). The short kernels are the faster ones there
# too: a 13-token check through SmolLM2's layer stack, Zen 4, int4 25.3 -> 18.8 ms, int8 17.8
# -> 17.1 (9 tokens 16.9 -> 11.9 and 15.6 -> 13.3; at 24 tokens int4 breaks even, int8 loses).
BF16_GEMM_MIN_TOKENS = native.EXACT_STEP_TOKENS + 1
# ... and on a CPU with AMX, from this many tokens (a long prefill chunk), a layer without bias
# multiplies its weight dequantized to plain bf16 rows by torch's GEMM (oneDNN on AMX tiles),
# the same values. Elsewhere (None) that kernel takes every step: oneDNN's vdpbf16ps GEMM beat
# it only by ~4% at 4,096 tokens on Zen 4 before the kernel's dequantizing got 10-30% cheaper
# (a wash at 1,024-2,048 there), and after it, on Zen 5, the kernel took 0.70-1.00x oneDNN's
# time at 512-4,096 tokens, dequantizing included (benchmarks/quant_onednn_crossover.py).
ONEDNN_MIN_TOKENS: int | None = 2048 if native.amx_here() else None
BF16_GEMM_KINDS = {"int8_rows": 0, "int8_groups": 1, "int4": 2, "int4_wide": 3}  # its Kind
INT4_GROUP_SIZES = (32, 64, 128)
QUANTIZATIONS = ("none", "int8", "int4", "gguf")  # gguf: layers/gguf_linear.py


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (int8 codes [out, in], float32 scale [out]); row = codes * scale,
    codes in [-127, 127] so the largest magnitude of each row is exact."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    codes = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return codes, scale


def quantize_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor,
                                                             torch.Tensor]:
    """[out, in] float -> (codes uint8 [out, in] in 0..15, float16 scale [out, in/group],
    float16 min [out, in/group]); w = codes * scale + min."""
    w = weight.detach().float()
    rows, cols = w.shape
    grouped = w.reshape(rows, cols // group, group)
    low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
    # Stored as float16 (2 of the 4.5 bits per weight at group 32 would otherwise be 4); the
    # codes are chosen against the rounded values, so they are what the kernel computes with.
    scale = ((high - low) / 15.0).clamp(min=2**-24).half()
    low = low.half()
    steps = (grouped - low.float()[..., None]) / scale.float()[..., None]
    codes = torch.round(steps).clamp(0, 15)
    return codes.reshape(rows, cols).to(torch.uint8), scale, low


def check_quantization(quantization: str, device: torch.device, dtype: torch.dtype,
                       in_features: list[int]) -> None:
    """ValueError, at startup, when this machine or this model cannot run the format (never
    text from a silent fallback)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, "
                         f"got {quantization!r}")
    if quantization == "none":
        return
    if device.type == "cuda":
        from banyan.layers.quant_cuda import check_cuda_quantization  # (it imports this module)

        check_cuda_quantization(quantization, dtype)
    elif device.type != "cpu":
        raise ValueError(f"--quantization {quantization} runs on CPU and CUDA (its kernels); "
                         f"this engine is on {device.type}")
    else:
        _check_cpu(quantization, dtype)
    if quantization == "int4":
        group = INT4_GROUP_SIZES[0]
        bad = sorted({k for k in in_features if k % group})
        if bad:
            raise ValueError(f"--quantization int4 groups {group} inputs; this model has "
                             f"linear layers with {bad} inputs")


def _check_cpu(quantization: str, dtype: torch.dtype) -> None:
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"--quantization {quantization} takes float32 or bfloat16 activations, "
                         f"not {dtype}")
    if native.load() is None:
        raise ValueError(f"--quantization {quantization} needs the native CPU kernels, which "
                         f"did not build here (a C++ compiler is required; "
                         f"{native.ENV_SWITCH}=0 turns them off)")


def quantization_runs(quantization: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether check_quantization accepts the format on this machine and dtype (what
    --quantization auto asks before it picks gguf)."""
    try:
        check_quantization(quantization, device, dtype, [])
    except ValueError:
        return False
    return True


class WeightOnlyMethod(LinearMethod):
    """A quantized weight made from a loaded dense layer (no weights of its own at build),
    which can say the values it computes with (`dequantized_weight`, the tests' reference)."""

    def create_weights(self, layer: Linear) -> None:
        raise NotImplementedError("quantized weights are made from a loaded dense layer (adopt)")

    @staticmethod
    def _take_dense(layer: Linear) -> torch.Tensor:
        """The layer's dense weight, removed (the codes replace it); its bias kept in float32."""
        weight = layer.weight.detach()
        del layer.weight
        bias = layer.bias
        if bias is not None:
            del layer.bias
            layer.bias = bias.detach().float().contiguous()
        return weight

    @abstractmethod
    def dequantized_weight(self, layer: Linear) -> torch.Tensor:
        """[out, in] float32: exactly the values the layer multiplies by."""


class _QuantMethod(WeightOnlyMethod):
    """Shared by the CPU int8/int4 methods: float32 activations into the kernel, the input's
    dtype out."""

    # the short kernels at every step size: tokens in blocks of 4 with one count of partial
    # sums (the float32 ones on x widened), or int4's bf16 kernel
    can_be_batch_invariant = True

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16:
            if x.numel() >= BF16_GEMM_MIN_TOKENS * layer.in_features \
                    and bf16_gemm_applies(layer.in_features) and not self.batch_invariant:
                return self._bf16_gemm(layer, x)
            short = self._bf16_short(layer, x)
            if short is not None:
                return short
        # A decode calls this ~120 times a token: the common case (2-D float32, contiguous)
        # skips the conversions, whose dispatches cost as much as a small layer's kernel.
        plain = x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous()
        flat = x if plain else x.reshape(-1, layer.in_features).to(torch.float32).contiguous()
        if flat.shape[0] >= DEQUANT_MIN_TOKENS and not self.batch_invariant:
            out = self._through_gemm(layer, flat)
        else:
            out = torch.empty(flat.shape[0], layer.out_features)
            with native.kernel_range("banyan::quantized_linear"):
                self._kernel(layer, flat, out)
        return out if plain else out.to(x.dtype).reshape(*x.shape[:-1], layer.out_features)

    def _kernel(self, layer: Linear, flat: torch.Tensor, out: torch.Tensor) -> None:
        """out [T, N] float32 = flat [T, K] float32 x the layer's weight (+ bias), natively."""
        raise NotImplementedError

    def _bf16_short(self, layer: Linear, x: torch.Tensor) -> torch.Tensor | None:
        """A short bf16 step by a kernel of bf16 activations (the native layer stack calls the
        same one), or None: the float32 kernel on x widened."""
        return None

    def _bf16_kernel_serves(self, layer: Linear, x: torch.Tensor) -> bool:
        """Whether a bf16 kernel of these codes (int4, int8: built where the CPU has
        AVX512-BF16 and VBMI) takes this bf16 step: a short one, or any where batch-invariant."""
        long_step = x.numel() >= DEQUANT_MIN_TOKENS * layer.in_features
        return native.codes_bf16_here() and (not long_step or self.batch_invariant)

    def _int8_bf16(self, layer: Linear, x: torch.Tensor, group: int) -> torch.Tensor | None:
        """int8 codes (a scale per row: group 0, or per group of inputs) times bf16 x by
        cpu_int8_bf16_linear.cpp, or None where it does not serve (its entry's input rule)."""
        if not self._bf16_kernel_serves(layer, x):
            return None
        flat = x.reshape(-1, layer.in_features).contiguous()
        out = torch.empty(flat.shape[0], layer.out_features, dtype=torch.bfloat16)
        with native.kernel_range("banyan::quantized_linear"):
            served = self._lib().banyan_int8_linear_bf16(
                flat.data_ptr(), flat.shape[0], layer.in_features, group,
                layer.codes.data_ptr(), layer.scale.data_ptr(), self._bias_ptr(layer),
                out.data_ptr(), layer.out_features, torch.get_num_threads())
        return out.reshape(*x.shape[:-1], layer.out_features) if served else None

    def _bf16_gemm(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] bf16 -> [..., N] bf16 through the weight rounded to bf16 (float32 sums)."""
        flat = x.reshape(-1, layer.in_features).contiguous()
        spec = self.native(layer)
        kind = BF16_GEMM_KINDS[spec.kind]
        mins = spec.mins.data_ptr() if spec.mins is not None else None
        if ONEDNN_MIN_TOKENS is not None and flat.shape[0] >= ONEDNN_MIN_TOKENS \
                and layer.bias is None:
            weight = torch.empty(layer.out_features, layer.in_features, dtype=torch.bfloat16)
            with native.kernel_range("banyan::dequantize_bf16"):
                self._lib().banyan_quant_dequant_bf16(
                    layer.in_features, kind, spec.weight.data_ptr(), spec.scale.data_ptr(), mins,
                    spec.group, weight.data_ptr(), layer.out_features, torch.get_num_threads())
            return torch.mm(flat, weight.t()).reshape(*x.shape[:-1], layer.out_features)
        out = torch.empty(flat.shape[0], layer.out_features, dtype=torch.bfloat16)
        with native.kernel_range("banyan::quantized_gemm_bf16"):
            self._lib().banyan_quant_gemm_bf16(
                flat.data_ptr(), flat.shape[0], layer.in_features, kind, spec.weight.data_ptr(),
                spec.scale.data_ptr(), mins, spec.group, self._bias_ptr(layer), out.data_ptr(),
                layer.out_features, torch.get_num_threads())
        return out.reshape(*x.shape[:-1], layer.out_features)

    def _dequantize(self, layer: Linear, p0: int, p1: int, out: torch.Tensor) -> None:
        """Panels [p0, p1) as float32 rows into out [(p1 - p0) * 16, K]."""
        raise NotImplementedError

    def _through_gemm(self, layer: Linear, flat: torch.Tensor) -> torch.Tensor:
        """A long step: slabs of the weight dequantized into a buffer that stays in cache, each
        multiplied by torch's GEMM (which beats the GEMV-style kernels from ~128 tokens)."""
        n, k = layer.out_features, layer.in_features
        panels = -(-n // PANEL)
        per = max(1, SLAB_BYTES // (PANEL * k * 4))
        buf = torch.empty(min(per, panels) * PANEL, k)
        out = torch.empty(flat.shape[0], n)
        for p0 in range(0, panels, per):
            p1 = min(panels, p0 + per)
            r0, r1 = p0 * PANEL, min(n, p1 * PANEL)
            weight = buf[: (p1 - p0) * PANEL]
            with native.kernel_range("banyan::dequantize"):
                self._dequantize(layer, p0, p1, weight)
            part = torch.mm(flat, weight[: r1 - r0].t())
            if layer.bias is not None:
                part += layer.bias[r0:r1]
            out[:, r0:r1] = part
        return out

    @staticmethod
    def _lib() -> Any:
        lib = native.load()
        assert lib is not None, "checked at startup (check_quantization)"
        return lib

    @staticmethod
    def _bias_ptr(layer: Linear) -> int | None:
        return layer.bias.data_ptr() if layer.bias is not None else None


class Int8Method(_QuantMethod):
    """int8 weights, one float32 scale per output row."""

    def adopt(self, layer: Linear) -> None:
        codes, scale = quantize_int8(self._take_dense(layer))
        layer.codes = to_panels(pad_rows(codes))
        layer.scale = pad_rows(scale[:, None])[:, 0].contiguous()

    def _kernel(self, layer: Linear, flat: torch.Tensor, out: torch.Tensor) -> None:
        self._lib().banyan_int8_linear_f32(
            flat.data_ptr(), flat.shape[0], layer.in_features, layer.codes.data_ptr(),
            layer.scale.data_ptr(), self._bias_ptr(layer), out.data_ptr(), layer.out_features,
            torch.get_num_threads())

    def _bf16_short(self, layer: Linear, x: torch.Tensor) -> torch.Tensor | None:
        return self._int8_bf16(layer, x, 0)

    def native(self, layer: Linear) -> NativeLinear:
        return NativeLinear("int8_rows", layer.codes, layer.scale)

    def _dequantize(self, layer: Linear, p0: int, p1: int, out: torch.Tensor) -> None:
        self._lib().banyan_int8_dequant_f32(layer.codes.data_ptr(), layer.scale.data_ptr(),
                                            layer.in_features, p0, p1, out.data_ptr(),
                                            torch.get_num_threads())

    def weight_bytes(self, layer: Linear) -> int:
        return layer.out_features * (layer.in_features + 4)

    def dequantized_weight(self, layer: Linear) -> torch.Tensor:
        codes = from_panels(layer.codes, layer.out_features).float()
        return codes * layer.scale[: layer.out_features, None]


class Int4Method(_QuantMethod):
    """4-bit codes with a float16 scale and minimum per group of `group` inputs: quantized from
    the layer's dense weight, or `given` (codes uint8 [out, in], scale and min [out, in / group]:
    a GGUF file's blocks, layers/gguf_linear.py; float16 for Q4_0 / Q4_1, float32 for Q4_K,
    whose products of two scales need more bits)."""

    def __init__(self, group: int = INT4_GROUP_SIZES[0],
                 given: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        if group not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group must be one of {INT4_GROUP_SIZES}, got {group}")
        self.group = group
        self._given = given

    def adopt(self, layer: Linear) -> None:
        if layer.in_features % self.group:
            raise ValueError(f"int4 groups of {self.group} need in_features divisible by it, "
                             f"got {layer.in_features}")
        dense = self._take_dense(layer)
        if self._given is None:
            codes, scale, low = quantize_int4(dense, self.group)
        else:
            codes, scale, low = self._given
            self._given = None
            if codes.shape != dense.shape:
                raise ValueError(f"codes of shape {tuple(codes.shape)} for a layer of "
                                 f"{tuple(dense.shape)}")
        codes = pad_rows(codes)
        pairs = codes[:, 0::2] | (codes[:, 1::2] << 4)  # input k even in the low nibble
        layer.codes = to_panels(pairs)
        layer.scale = to_panels(pad_rows(scale))
        layer.mins = to_panels(pad_rows(low))

    def _kernel(self, layer: Linear, flat: torch.Tensor, out: torch.Tensor) -> None:
        group_sums = torch.empty(flat.shape[0], layer.in_features // self.group)
        lib = self._lib()
        fn = lib.banyan_int4s_linear_f32 if self._wide(layer) else lib.banyan_int4_linear_f32
        fn(
            flat.data_ptr(), flat.shape[0], layer.in_features, self.group,
            layer.codes.data_ptr(), layer.scale.data_ptr(), layer.mins.data_ptr(),
            self._bias_ptr(layer), out.data_ptr(), layer.out_features, group_sums.data_ptr(),
            torch.get_num_threads())

    def _bf16_short(self, layer: Linear, x: torch.Tensor) -> torch.Tensor | None:
        if not self._bf16_kernel_serves(layer, x):
            return None
        flat = x.reshape(-1, layer.in_features).contiguous()
        out = torch.empty(flat.shape[0], layer.out_features, dtype=torch.bfloat16)
        group_sums = torch.empty(flat.shape[0], layer.in_features // self.group)
        with native.kernel_range("banyan::quantized_linear"):
            self._lib().banyan_int4_linear_bf16(
                flat.data_ptr(), flat.shape[0], layer.in_features, self.group,
                layer.codes.data_ptr(), layer.scale.data_ptr(), layer.mins.data_ptr(),
                self._wide(layer), self._bias_ptr(layer), out.data_ptr(), layer.out_features,
                group_sums.data_ptr(), torch.get_num_threads())
        return out.reshape(*x.shape[:-1], layer.out_features)

    def native(self, layer: Linear) -> NativeLinear:
        kind = "int4_wide" if self._wide(layer) else "int4"
        return NativeLinear(kind, layer.codes, layer.scale, layer.mins, self.group)

    def _dequantize(self, layer: Linear, p0: int, p1: int, out: torch.Tensor) -> None:
        lib = self._lib()
        fn = lib.banyan_int4s_dequant_f32 if self._wide(layer) else lib.banyan_int4_dequant_f32
        fn(
            layer.codes.data_ptr(), layer.scale.data_ptr(), layer.mins.data_ptr(),
            layer.in_features, self.group, p0, p1, out.data_ptr(), torch.get_num_threads())

    @staticmethod
    def _wide(layer: Linear) -> bool:
        """float32 scales and minimums (GGUF's K-quants) rather than float16."""
        return layer.scale.dtype == torch.float32

    def weight_bytes(self, layer: Linear) -> int:
        groups = layer.in_features // self.group
        per_group = 8 if self._wide(layer) else 4
        return layer.out_features * (layer.in_features // 2 + per_group * groups)

    def dequantized_weight(self, layer: Linear) -> torch.Tensor:
        return int4_values(from_panels(layer.codes, layer.out_features),
                           from_panels(layer.scale, layer.out_features),
                           from_panels(layer.mins, layer.out_features), self.group)


def int4_values(pairs: torch.Tensor, scale: torch.Tensor, low: torch.Tensor,
                group: int) -> torch.Tensor:
    """Codes two a byte ([out, in / 2] uint8, input k even in the low nibble) with a scale and
    minimum per `group` inputs -> the [out, in] float32 values code x scale + minimum."""
    codes = torch.stack([pairs & 0xF, pairs >> 4], dim=-1).reshape(pairs.shape[0], -1)
    scale_per_input = scale.float().repeat_interleave(group, dim=1)
    low_per_input = low.float().repeat_interleave(group, dim=1)
    return codes.float() * scale_per_input + low_per_input


def quantized_method(quantization: str, device: torch.device) -> type[LinearMethod] | None:
    """The linear method class quantizing at load for a --quantization value on `device`
    (None for 'none' and for 'gguf', whose methods are made from the file's blocks)."""
    if device.type == "cuda" and quantization in ("int8", "int4"):
        from banyan.layers.quant_cuda import TritonInt4Method, TritonInt8Method  # (as above)

        return TritonInt8Method if quantization == "int8" else TritonInt4Method
    return {"none": None, "int8": Int8Method, "int4": Int4Method, "gguf": None}[quantization]


def dequantize_in_place(model: nn.Module) -> int:
    """Swap every quantized Linear back to a dense float32 weight holding exactly the values it
    computes with (the torch reference of the tests) -> how many."""
    from banyan.layers.linear import DenseMethod

    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and isinstance(module.method, WeightOnlyMethod):
            weight = module.method.dequantized_weight(module)
            module.weight = nn.Parameter(weight, requires_grad=False)
            if module.bias is not None:
                module.bias = nn.Parameter(module.bias, requires_grad=False)
            module.method = DenseMethod()
            count += 1
    return count
