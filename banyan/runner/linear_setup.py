"""Which method each linear layer of a loaded model computes with: the quantized formats
(--quantization, a GGUF file's blocks), or for unquantized weights the kernel
(--linear-kernel): oneDNN-prepacked bf16, the native skinny kernels, or F.linear as loaded."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from banyan.args import check_linear_kernel
from banyan.layers.f32_linear import SkinnyF32Method
from banyan.layers.gemm_tiles import gemm_tiles_route
from banyan.layers.gguf_linear import repack_gguf_linears
from banyan.layers.linear import (DenseMethod, Linear, LinearMethod,
                                  PackedBf16Method, PairsBf16Method, SkinnyBf16Method,
                                  convert_linears)
from banyan.layers.quant import check_quantization, quantized_method
from banyan.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)
_NATIVE_NEEDS = ("linear_kernel native needs float32 or bfloat16 on CPU, unquantized, with the "
                 "native kernels built")


def convert_model_linears(model: LlamaForCausalLM, device: torch.device, dtype: torch.dtype,
                          quantization: str, linear_kernel: str, gguf_file: Path | None,
                          batch_invariant: bool = False) -> None:
    """Quantize the linears (the tied head too: a quantized copy beside the embedding,
    which lookups keep reading), or else pick their kernel: oneDNN-prepacked bf16 where it
    can, the native skinny float32 kernel where asked or measured faster here.
    batch_invariant: unquantized linears only on native kernels, which have a
    batch-invariant path (runner/batch_invariant.py), never a library GEMM."""
    check_quantization(quantization, device, dtype,
                       [m.in_features for m in model.modules() if isinstance(m, Linear)])
    check_linear_kernel(linear_kernel)
    # The bf16 GEMM's long steps (quantized weights, dense ones in its pairs) on AMX tiles where
    # they pay; never in the deterministic mode (batch_invariant.py keeps them off)
    if device.type == "cpu" and not batch_invariant:
        gemm_tiles_route(dtype)
    if batch_invariant and quantization == "none" and linear_kernel == "auto":
        linear_kernel = "native"  # (torch's GEMMs: make_batch_invariant refuses them)
    if quantization == "gguf":
        if gguf_file is None:
            raise ValueError("--quantization gguf computes with a GGUF file's blocks: "
                             "--model must be a .gguf file (or a folder holding one)")
        _split_tied_head(model)
        repacked, dense = repack_gguf_linears(model, gguf_file)
        logger.info("%d linear layers compute from %s's blocks (%d stay dense)", repacked,
                    gguf_file.name, len(dense))
        if batch_invariant:  # the types without a kernel of their own: the skinny one
            skinny = _dense_method(model, device, dtype, "native")
            for layer in model.modules():
                if isinstance(layer, Linear) and type(layer.method) is DenseMethod:
                    layer.convert(skinny())
        elif dense and linear_kernel != "auto":
            logger.info("--linear-kernel %s does not apply to them", linear_kernel)
        return
    method = quantized_method(quantization, device)
    if method is not None and linear_kernel == "native":
        raise ValueError(_NATIVE_NEEDS)
    method = method or _dense_method(model, device, dtype, linear_kernel)
    if method is None:
        return
    _split_tied_head(model)
    skip: tuple[Linear, ...] = ()
    if issubclass(method, SkinnyBf16Method):  # the layer stack stops before the LM head:
        head = model.lm_head if model.lm_head is not None else model.tied_head  # one copy
        packs = PackedBf16Method.available(device, dtype)
        head.convert(PairsBf16Method() if method.takes_gemm(head)
                     else SkinnyBf16Method() if batch_invariant or not packs
                     else PackedBf16Method())
        skip = (head,)
    converted = convert_linears(model, method, skip=skip)
    logger.info("%d linear weights converted to %s", converted, method.__name__)


def _dense_method(model: LlamaForCausalLM, device: torch.device, dtype: torch.dtype,
                  linear_kernel: str) -> type[LinearMethod] | None:
    """The unquantized linears' method: the native skinny kernel where asked, or (auto)
    where it measured faster here (in bf16: where the CPU has vdpbf16ps and the plain copy
    beside the packed one is affordable); else oneDNN-packed bf16, or F.linear on the
    weights as loaded (None)."""
    packed = PackedBf16Method.available(device, dtype)
    skinny = SkinnyBf16Method if dtype == torch.bfloat16 else SkinnyF32Method
    runs = skinny.available(device, dtype)
    if linear_kernel == "native":
        if not runs:
            raise ValueError(_NATIVE_NEEDS)
        return skinny
    if linear_kernel != "auto" or not runs:
        chosen = False
    elif skinny is SkinnyBf16Method:
        chosen = (SkinnyBf16Method.suits_here() and
                  SkinnyBf16Method.affordable(_layer_weight_bytes(model)))
    else:
        chosen = SkinnyF32Method.chosen_here(_largest_linear_weight(model))
    return skinny if chosen else PackedBf16Method if packed else None


def _layer_weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes of the decoder layers' linear weights (the LM head not included)."""
    return sum(m.weight.numel() * m.weight.element_size()
               for m in model.layers.modules() if isinstance(m, Linear))


def _split_tied_head(model: LlamaForCausalLM) -> None:
    """A tied LM head in a layout of its own (packed or quantized): a Linear beside the
    embedding, which lookups keep reading."""
    if model.lm_head is None:
        model.tied_head = Linear.from_weight(model.embed_tokens.weight)


def _largest_linear_weight(model: LlamaForCausalLM) -> torch.Tensor:
    """The biggest projection weight (the LM head, tied or not, in small models)."""
    weights = [m.weight for m in model.modules() if isinstance(m, Linear)]
    weights.append(model.embed_tokens.weight)
    return max(weights, key=lambda w: w.numel()).detach()
