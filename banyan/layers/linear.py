"""Linear layers that own how their weight is stored and applied (a `LinearMethod`), and how each
checkpoint tensor is loaded into them (a per-parameter `weight_loader`).

The model builds every projection as a `Linear` with the dense method; the runner may then
`convert` layers to another method (oneDNN-prepacked bf16 today; int8/int4/GGUF blocks later),
which takes the loaded weight over. Every method reports `weight_bytes`, the bytes a forward
reads, so nothing outside needs to know the layouts.

Loading: the loader asks each parameter for its `weight_loader(param, tensor, start, rows)`,
which places a checkpoint tensor at rows [start, start + rows) of the parameter (a fused
projection gets one call per part). A quantized method gives its parameters loaders that
quantize or copy blocks instead.
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cache

import torch
from torch import nn

from banyan.kernels import native
from banyan.layers.panels import pack_bf16_pairs, unpack_bf16_pairs

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NativeLinear:
    """What the native layer stack (kernels/cpu_layer_stack.cpp) needs to run a projection with
    the same kernel its method's `apply` uses for a few tokens: the kernel's name
    (models/native_stack.py: LINEAR_KINDS) and the tensors it reads."""

    kind: str
    weight: torch.Tensor
    scale: torch.Tensor | None = None
    mins: torch.Tensor | None = None
    group: int = 0
    bias: torch.Tensor | None = None  # as the kernel reads it, where not the layer's own


def dense_weight_loader(param: nn.Parameter, loaded: torch.Tensor, start: int = 0,
                        rows: int | None = None) -> None:
    """Copy `loaded` into rows [start, start + rows) of `param` (all of it when rows is None),
    cast to the parameter's dtype and device; ValueError on a shape mismatch."""
    target = param if rows is None else param.narrow(0, start, rows)
    if tuple(loaded.shape) != tuple(target.shape):
        raise ValueError(f"shape {tuple(loaded.shape)}, the config expects {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(loaded)


class LinearMethod(ABC):
    """How a Linear stores its weight and computes x @ W^T + b."""

    # Whether `apply` has, for every step size, a kernel whose bits for a token do not depend
    # on the step's other tokens; and whether it is told to use only that one
    # (runner/batch_invariant.py, --enable-deterministic-inference).
    can_be_batch_invariant = False
    batch_invariant = False

    @abstractmethod
    def create_weights(self, layer: Linear) -> None:
        """Register the layer's parameters (on whatever device is current: meta at build)."""

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] -> [T, out]"""

    @abstractmethod
    def weight_bytes(self, layer: Linear) -> int:
        """Bytes of weight one forward reads."""

    def adopt(self, layer: Linear) -> None:
        """Take over a layer loaded with another method (its dense weight), in place."""
        raise NotImplementedError(f"{type(self).__name__} cannot convert a loaded layer")

    def make_batch_invariant(self, layer: Linear) -> None:
        """From now on every step on the step-size-invariant kernel (can_be_batch_invariant)."""
        self.batch_invariant = True

    def native(self, layer: Linear) -> NativeLinear | None:
        """The native kernel `apply` runs for steps of a few tokens (up to the layer stack's
        MAX_TOKENS), or None (a library GEMM, which the layer stack cannot call)."""
        return None


class DenseMethod(LinearMethod):
    """A plain [out, in] weight in the model dtype (F.linear)."""

    def create_weights(self, layer: Linear) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features),
                                    requires_grad=False)
        layer.weight.weight_loader = dense_weight_loader  # type: ignore[attr-defined]
        if layer.has_bias:
            layer.bias = nn.Parameter(torch.empty(layer.out_features), requires_grad=False)
            layer.bias.weight_loader = dense_weight_loader  # type: ignore[attr-defined]

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, layer.weight, layer.bias)

    def weight_bytes(self, layer: Linear) -> int:
        return layer.weight.numel() * layer.weight.element_size()


class PackedBf16Method(LinearMethod):
    """bf16 weights prepacked once by oneDNN, for CPU.

    `F.linear` on a CPU bf16 weight hands oneDNN a row-major matrix, which it reorders into its
    blocked layout on every call; reordering once at load (`mkldnn._reorder_linear_weight`, what
    torch.compile's weight freezing does) measured 1.5-1.8x faster at 64 tokens and ~2x at one
    token (the LM head: 1.86 -> 0.83 ms) on a 2-core Zen 4, with bit-identical results. float32 is
    left alone: its packed GEMM sums in another order (~1e-4), and float32 is the precision the
    engine is checked against. The packed tensor replaces the plain weight (no second copy)."""

    def create_weights(self, layer: Linear) -> None:
        raise NotImplementedError("packed weights are made from a loaded dense layer (adopt)")

    def adopt(self, layer: Linear) -> None:
        weight = layer.weight.detach()
        layer.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        del layer.weight  # the packed copy replaces it
        bias = layer.bias
        if bias is not None:
            del layer.bias
            layer.bias = bias.detach()  # a plain attribute now: the op takes a tensor

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")

    def weight_bytes(self, layer: Linear) -> int:
        return layer.out_features * layer.in_features * 2  # (bf16, packed or plain)

    def dequantized_weight(self, layer: Linear) -> torch.Tensor:
        """The weight [N, K] (float32), as the quantized methods give theirs: read back through
        the packed GEMM, where times the identity each output is one product, w * 1, so exact
        (an untied head on AMX keeps only the packed copy: the draft's 4-bit head is made
        from it)."""
        if getattr(layer, "packed", None) is None:
            return layer.weight.detach().float()
        eye = torch.eye(layer.in_features, dtype=torch.bfloat16)
        rows = torch.ops.mkldnn._linear_pointwise(eye, layer.packed, None, "none", [], "")
        return rows.t().contiguous().float()

    @staticmethod
    def available(device: torch.device, dtype: torch.dtype) -> bool:
        """Whether this torch build packs weights of this dtype on this device."""
        return device.type == "cpu" and dtype == torch.bfloat16 and _onednn_packs_bf16()


@cache
def _onednn_packs_bf16() -> bool:
    """Whether oneDNN packs bf16 weights here, checked once on a tiny weight against F.linear
    (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT: not on Zen 1-3)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        with torch.inference_mode():
            layer = Linear.from_weight(torch.randn(24, 16).bfloat16())
            x = torch.randn(3, 16).bfloat16()
            want = layer(x)
            layer.convert(PackedBf16Method())
            return bool(torch.equal(layer(x), want))
    except (RuntimeError, AttributeError) as exc:
        logger.info("oneDNN weight packing unavailable (%s): plain linears", exc)
        return False


class SkinnyBf16Method(PackedBf16Method):
    """bf16 on CPU, the way f32_linear.SkinnyF32Method is float32: short steps go through a
    native kernel on a second copy of the weight beside oneDNN's packed one, which is also what
    lets the layer stack run a bf16 model's decode steps in one native call. Where the bf16 GEMM
    kernel applies (`takes_gemm`), that copy is in the GEMM's pairs (pack_bf16_pairs) and every
    step of up to GEMM_ROWS tokens runs it; elsewhere (an odd width) it is the plain weight,
    and steps of up to SKINNY_ROWS tokens run the skinny bf16 kernel. Both sum in float32 and
    round each output once, like oneDNN; wider steps take oneDNN's GEMM on the packed copy
    (F.linear on the plain one where oneDNN packs no bf16: Zen 1-3, asked for by name). `auto`
    picks this method only where the second copy is affordable (`affordable`) and the CPU has
    the instruction the kernels are built on (`suits_here`)."""

    # Up to 16 tokens on a plain weight (passes of 8 over the weights), each token's outputs the
    # bits it gets alone: a speculative check of up to 16 tokens then computes every token as
    # its decode did (oneDNN's GEMM rounds otherwise: its text parted from the plain text's at
    # near-ties). The price where the plain weight serves (odd widths), measured on
    # Zen 5 before: 16 requests decoded ~5% slower than with oneDNN's packed GEMM alone (median
    # of 5 alternating runs, 466 vs 491 tok/s); at 8 the two were even; at 1 the stack is 2x.
    SKINNY_ROWS = native.EXACT_STEP_TOKENS
    # Up to 256 tokens (batched decodes, short chunks) the bf16 GEMM kernel on the pairs, which
    # the layer stack calls too; longer steps take oneDNN's. Over SmolLM2's 120 projections on
    # Zen 5 (2 threads) it matched the skinny kernel at 1 token and beat it from 2 (8 tokens:
    # 6.1-6.7 vs 10.7-12.5 ms), and beat the same kernel transposing the plain weight per call
    # by ~7% at 64 tokens.
    GEMM_ROWS = 256
    MEMORY_SHARE = 8  # the second copies may take up to 1/8 of the machine's memory
    can_be_batch_invariant = True  # (either kernel, at every step size)

    def adopt(self, layer: Linear) -> None:
        plain = layer.weight.detach().contiguous()
        if _onednn_packs_bf16():
            super().adopt(layer)  # packs a copy and drops the parameter
        else:  # (Zen 1-3) long steps on F.linear over the plain weight, which stays
            layer.packed = None
        pairs = self.takes_gemm(layer)
        if pairs:
            _store_pairs(layer, plain, layer.bias)
        if not pairs or layer.packed is None:  # (F.linear's long steps read the plain weight)
            layer.weight = nn.Parameter(plain, requires_grad=False)

    def native(self, layer: Linear) -> NativeLinear | None:
        if hasattr(layer, "pairs"):
            return NativeLinear("pairs_bf16", layer.pairs, bias=layer.pairs_bias)
        return NativeLinear("skinny_bf16", layer.weight)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        short = self.batch_invariant or x.shape[0] <= self.GEMM_ROWS
        if x.dim() == 2 and hasattr(layer, "pairs") and short:
            return native.bf16_pairs_gemm(x.contiguous(), layer.pairs, layer.out_features,
                                          layer.pairs_bias)
        if x.dim() == 2 and (self.batch_invariant or x.shape[0] <= self.SKINNY_ROWS):
            return native.skinny_linear(x.contiguous(), layer.weight, layer.bias)
        if layer.packed is None:
            return nn.functional.linear(x, layer.weight, layer.bias)
        return super().apply(layer, x)

    @classmethod
    def takes_gemm(cls, layer: Linear) -> bool:
        """Whether the layer's steps of up to GEMM_ROWS tokens go through the bf16 GEMM kernel
        on its pairs (the one rule for `adopt`, and so for `apply` and the native layer stack):
        where it runs on vdpbf16ps (an even width), on CPUs with AMX too, its long steps' products
        on AMX tiles where they check out (layers/gemm_tiles.py). Measured there against
        oneDNN's GEMM on AMX tiles (Xeon family 6 model 207, 2026-12-06,
        benchmarks/stack_vs_per_op.py, one process): batch-1 decode 1.51x (the head in pairs
        too, so the stack picks greedy tokens and runs bursts of steps), random 64 x 128/128
        even (13.3 vs 13.1 s, runs spread 10.7-15.2 s)."""
        return native.bf16_gemm_applies(layer.in_features)

    @staticmethod
    def available(device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cpu" and dtype == torch.bfloat16 and native.load() is not None

    @classmethod
    def affordable(cls, plain_bytes: int) -> bool:
        """Whether a second copy of `plain_bytes` of weights fits the memory share."""
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return plain_bytes * cls.MEMORY_SHARE <= total

    @staticmethod
    def suits_here() -> bool:
        """Whether this CPU has vdpbf16ps (AVX512-BF16), which the kernel is built on (the
        library is compiled for this CPU). Not a timing: one linear at a few tokens takes tens
        of microseconds either way (a 3-run timing flipped between runs on Zen 5), while what
        the kernel buys is the layer stack, 55-59 -> 79-89 tok/s at batch 1 there."""
        return "avx512_bf16" in native.cpu_flags().split()


class PairsBf16Method(LinearMethod):
    """A bf16 LM head on CPU stored only in the bf16 GEMM's pairs (pack_bf16_pairs), every step
    through that kernel: the head of a model whose layers take SkinnyBf16Method, in place of
    oneDNN's packed copy (the layer stack stops before the head, so it needs no second copy).
    SmolLM2's head (49,152 x 576) on Zen 4 (benchmarks/bf16_head.py): 0.8x oneDNN's time at 1 and
    8 tokens, 0.84-0.88x at 16-32, even at 64-128, 2% slower at 256 (batch-1 decode 1.12x in one
    process beside the packed head); and each row's sum is the same whatever the step's size."""

    can_be_batch_invariant = True

    def create_weights(self, layer: Linear) -> None:
        raise NotImplementedError("pairs are made from a loaded dense layer (adopt)")

    def adopt(self, layer: Linear) -> None:
        bias, layer.bias = layer.bias, None
        _store_pairs(layer, layer.weight.detach(), bias)
        del layer.weight

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, layer.in_features).contiguous()
        out = native.bf16_pairs_gemm(flat, layer.pairs, layer.out_features, layer.pairs_bias)
        return out.reshape(*x.shape[:-1], layer.out_features)

    def weight_bytes(self, layer: Linear) -> int:
        return layer.out_features * layer.in_features * 2

    def native(self, layer: Linear) -> NativeLinear | None:
        return NativeLinear("pairs_bf16", layer.pairs, bias=layer.pairs_bias)

    def dequantized_weight(self, layer: Linear) -> torch.Tensor:
        """The weight [N, K] (float32) out of its pairs, as the quantized methods give theirs."""
        return unpack_bf16_pairs(layer.pairs, layer.out_features).float()


def _store_pairs(layer: Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """The weight in the bf16 GEMM's pairs; the bias as it adds one: float32 (a bf16 one widened,
    exact), added where the skinny kernel and oneDNN add it, before the one rounding."""
    layer.pairs = pack_bf16_pairs(weight)
    layer.pairs_bias = None if bias is None else bias.detach().float().contiguous()


class Linear(nn.Module):
    # Bumped whenever any Linear's method is set: the native layer stack, which holds raw
    # pointers into its projections' weights, compares this one number per step instead of
    # every projection's method (121 attribute reads a step, ~0.1 ms with cold caches).
    generation = 0

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 method: LinearMethod | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.has_bias = in_features, out_features, bias
        self.bias: torch.Tensor | None = None
        self.method = method or DenseMethod()
        self.method.create_weights(self)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        """A dense layer sharing an existing weight (a tied LM head)."""
        with torch.device("meta"):
            layer = cls(weight.shape[1], weight.shape[0], bias is not None)
        layer.weight = nn.Parameter(weight.detach(), requires_grad=False)
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach(), requires_grad=False)
        return layer

    @property
    def method(self) -> LinearMethod:
        return self._method

    @method.setter
    def method(self, method: LinearMethod) -> None:
        self._method = method
        Linear.generation += 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._method.apply(self, x)

    def convert(self, method: LinearMethod) -> None:
        method.adopt(self)
        self.method = method

    def weight_bytes(self) -> int:
        return self.method.weight_bytes(self)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.has_bias}, method={type(self.method).__name__}")


def convert_linears(model: nn.Module, method_factory: type[LinearMethod],
                    skip: tuple[nn.Module, ...] = ()) -> int:
    """Convert every Linear under `model` but those in `skip` to a new instance of a method ->
    how many."""
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and not any(module is s for s in skip):
            module.convert(method_factory())
            count += 1
    return count


def model_weight_bytes(model: nn.Module, skip: tuple[nn.Module, ...] = ()) -> int:
    """Bytes of weight a forward reads: each Linear's by its method, other parameters as
    stored; modules in `skip` (a tied head's copy of the embedding) are not counted."""
    total = 0
    for module in model.modules():
        if any(module is s for s in skip):
            continue
        if isinstance(module, Linear):
            total += module.weight_bytes()
        else:
            total += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
    return total
