"""`--quantization gguf`: the linear layers of a GGUF model computed from the file's own blocks.

A GGUF model loads dequantized (models/gguf_loader.py converts it once into a float checkpoint);
with this mode each linear layer whose file tensor is Q8_0, Q4_0, Q4_1, Q5_0, Q4_K or Q6_K then
swaps its dense weight for those blocks, repacked into the CPU kernels' panel layout without
changing a value:

- Q4_1 (32 inputs: float16 d and m, 4-bit q): value = q * d + m, which is exactly `Int4Method`'s
  format (codes, a float16 scale and minimum per 32 inputs);
- Q4_0 (float16 d, 4-bit q): value = (q - 8) * d = q * d + (-8 d), the same with minimum -8 d
  (exact in float16: a power-of-two multiple);
- Q8_0 (float16 d, int8 q): value = q * d, and Q5_0 (5-bit q): value = (q - 16) d, both
  `GroupInt8Method` (cpu_int8g_linear.cpp) with the scale widened to float32;
- Q4_K and Q6_K (super-blocks of 256 with sub-block scales): the products of the two scales,
  exact in float32, become a float32 scale (and minimum) per 32 (int4) or per 16 (int8) inputs
  (`decode_k_quant`).

So the repacked layer computes with exactly the values transformers dequantizes (tested bit for
bit), reading 0.56-1.25 bytes per weight instead of 4. A tied LM head takes the embedding's
blocks; the embedding itself stays dense for lookups (a step reads a few of its rows). Tensors
of other types (Q5_1, Q2_K, Q3_K, Q5_K) and fused layers whose parts differ in type stay dense,
and the log says which.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from banyan.layers.linear import Linear, NativeLinear
from banyan.layers.panels import from_panels, pad_rows, to_panels
from banyan.layers.quant import Int4Method, _QuantMethod

if TYPE_CHECKING:
    from banyan.models.gguf_loader import GGUFTensor

logger = logging.getLogger(__name__)

BLOCK = 32  # inputs per block of Q8_0, Q4_0, Q4_1 (and per scale of Q4_K)
SUPER = 256  # inputs per super-block of the K-quants
REPACKED_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K")
GROUP = {"Q6_K": 16}  # inputs per scale, where not BLOCK
WITH_MIN = ("Q4_0", "Q4_1", "Q4_K")  # decoded with a minimum per group (the int4 method)

Decoded = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of every block, as float32."""
    return blocks[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def decode_k_quant(raw: np.ndarray, ggml_type: str, cols: int) -> Decoded:
    """Q4_K: per 256 inputs float16 d and dmin, 8 six-bit scales and mins, 4-bit q; value =
    (d sc) q - (dmin m) -> int4 codes with float32 scale d sc and min -dmin m per 32 (both
    products exact in float32). Q6_K: 6-bit q in 4 + 2 bits, int8 scales per 16, float16 d;
    value = (d sc)(q - 32) -> int8 codes q - 32 with a float32 scale per 16."""
    rows, nb = raw.shape[0], cols // SUPER
    if ggml_type == "Q4_K":
        blocks = np.ascontiguousarray(raw).reshape(rows, nb, 144)
        d, dmin, packed = _f16(blocks, 0), _f16(blocks, 2), blocks[..., 4:16]
        sc = np.concatenate([packed[..., 0:4] & 63,
                             (packed[..., 8:12] & 0xF) | ((packed[..., 0:4] >> 6) << 4)], -1)
        mn = np.concatenate([packed[..., 4:8] & 63,
                             (packed[..., 8:12] >> 4) | ((packed[..., 4:8] >> 6) << 4)], -1)
        q = blocks[..., 16:144].reshape(rows, nb, 4, 32)  # 64 inputs each: low, then high
        codes = np.stack([q & 0xF, q >> 4], axis=3).reshape(rows, cols)
        scale = (d[..., None] * sc).reshape(rows, -1)
        low = -(dmin[..., None] * mn).reshape(rows, -1)
        return (torch.from_numpy(codes.astype(np.uint8)), torch.from_numpy(scale),
                torch.from_numpy(low))
    blocks = np.ascontiguousarray(raw).reshape(rows, nb, 210)
    ql = blocks[..., :128].reshape(rows, nb, 2, 64)
    qh = blocks[..., 128:192].reshape(rows, nb, 2, 1, 32)
    scales = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)
    d = _f16(blocks, 208)
    low4 = np.concatenate([ql & 0xF, ql >> 4], axis=-1).reshape(rows, nb, 2, 4, 32)
    high2 = (qh >> (2 * np.arange(4, dtype=np.uint8))[None, None, None, :, None]) & 3
    codes = (low4 | (high2 << 4)).astype(np.int16) - 32
    scale = (d[..., None] * scales).reshape(rows, -1)
    return torch.from_numpy(codes.reshape(rows, cols).astype(np.int8)), \
        torch.from_numpy(scale), None


def decode_blocks(raw: np.ndarray, ggml_type: str, cols: int) -> Decoded:
    """raw uint8 [rows, bytes] blocks of one tensor -> (codes [rows, cols], scale
    [rows, cols / group], min [rows, cols / group] or None): Q4_x codes uint8 0..15 with
    float16 scale and min (float32 for Q4_K); Q8_0 / Q6_K codes int8 with a float32 scale
    and no min."""
    rows, nb = raw.shape[0], cols // BLOCK
    if ggml_type in ("Q4_K", "Q6_K"):
        return decode_k_quant(raw, ggml_type, cols)
    if ggml_type == "Q5_0":  # float16 d, 32 high bits, 4-bit q: value = (q | h << 4) - 16) d
        blocks = np.ascontiguousarray(raw).reshape(rows, nb, 22)
        high = blocks[..., 2:6].copy().view("<u4")  # [rows, nb, 1]
        bits = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        qs = blocks[..., 6:22]
        q = np.concatenate([qs & 0xF, qs >> 4], axis=-1) | (bits << 4)
        codes = (q.astype(np.int16) - 16).astype(np.int8).reshape(rows, cols)
        return torch.from_numpy(codes), torch.from_numpy(_f16(blocks, 0)), None
    if ggml_type == "Q8_0":
        blocks = np.ascontiguousarray(raw).reshape(rows, nb, 34)
        d = blocks[..., :2].copy().view(np.float16)[..., 0]
        codes = blocks[..., 2:].copy().view(np.int8).reshape(rows, cols)
        return torch.from_numpy(codes), torch.from_numpy(d.astype(np.float32)), None
    if ggml_type not in ("Q4_0", "Q4_1"):
        raise ValueError(f"no repacking for ggml type {ggml_type}")
    size = 18 if ggml_type == "Q4_0" else 20
    blocks = np.ascontiguousarray(raw).reshape(rows, nb, size)
    d = blocks[..., :2].copy().view(np.float16)[..., 0]
    qs = blocks[..., size - 16:]
    # element j of a block in the low nibble of byte j, element j + 16 in its high nibble
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(rows, cols)
    if ggml_type == "Q4_0":
        low = (d.astype(np.float32) * -8).astype(np.float16)
    else:
        low = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    return (torch.from_numpy(codes.astype(np.uint8)), torch.from_numpy(d.copy()),
            torch.from_numpy(low.copy()))


class GroupInt8Method(_QuantMethod):
    """int8 codes with a float32 scale per group of inputs (GGUF's Q8_0 blocks, repacked)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, group: int = BLOCK) -> None:
        self.group = group
        self._given: tuple[torch.Tensor, torch.Tensor] | None = (codes, scale)

    def adopt(self, layer: Linear) -> None:
        assert self._given is not None, "a GroupInt8Method adopts one layer"
        codes, scale = self._given
        self._given = None
        self._take_dense(layer)
        if codes.shape != (layer.out_features, layer.in_features):
            raise ValueError(f"codes of shape {tuple(codes.shape)} for a layer of "
                             f"{layer.out_features} x {layer.in_features}")
        layer.codes = to_panels(pad_rows(codes))
        layer.scale = to_panels(pad_rows(scale.float()))

    def _kernel(self, layer: Linear, flat: torch.Tensor, out: torch.Tensor) -> None:
        self._lib().banyan_int8g_linear_f32(
            flat.data_ptr(), flat.shape[0], layer.in_features, self.group,
            layer.codes.data_ptr(), layer.scale.data_ptr(), self._bias_ptr(layer),
            out.data_ptr(), layer.out_features, torch.get_num_threads())

    def _bf16_short(self, layer: Linear, x: torch.Tensor) -> torch.Tensor | None:
        return self._int8_bf16(layer, x, self.group)

    def native(self, layer: Linear) -> NativeLinear:
        return NativeLinear("int8_groups", layer.codes, layer.scale, group=self.group)

    def _dequantize(self, layer: Linear, p0: int, p1: int, out: torch.Tensor) -> None:
        self._lib().banyan_int8g_dequant_f32(
            layer.codes.data_ptr(), layer.scale.data_ptr(), layer.in_features, self.group, p0,
            p1, out.data_ptr(), torch.get_num_threads())

    def weight_bytes(self, layer: Linear) -> int:
        return layer.out_features * (layer.in_features + 4 * (layer.in_features // self.group))

    def dequantized_weight(self, layer: Linear) -> torch.Tensor:
        codes = from_panels(layer.codes, layer.out_features).float()
        scale = from_panels(layer.scale, layer.out_features)
        return codes * scale.repeat_interleave(self.group, dim=1)


def method_for_blocks(pieces: list[Decoded], group: int = BLOCK) -> _QuantMethod:
    """The method computing with these decoded blocks (the parts of one layer, in row order)."""
    codes = torch.cat([p[0] for p in pieces])
    scale = torch.cat([p[1] for p in pieces])  # float16 beside float32 parts: widened, exactly
    if pieces[0][2] is None:
        return GroupInt8Method(codes, scale, group)
    low = torch.cat([p[2] for p in pieces if p[2] is not None])
    return Int4Method(BLOCK, given=(codes, scale, low))


def _parts_by_linear(model: nn.Module, gguf_file: Path
                     ) -> dict[str, list[tuple[int, GGUFTensor]]]:
    """The file's tensors of each Linear of `model` (rows start, tensor), in row order; a tied
    LM head in a layout of its own (model.tied_head) reads the embedding's."""
    from banyan.models.gguf_loader import iter_gguf_tensors, open_gguf

    modules = dict(model.named_modules())
    layout = model.checkpoint_layout()
    parts: dict[str, list[tuple[int, GGUFTensor]]] = defaultdict(list)
    reader, arch = open_gguf(gguf_file)
    for tensor in iter_gguf_tensors(reader, arch):
        if tensor.name == "model.embed_tokens.weight" and \
                getattr(model, "tied_head", None) is not None:
            parts["tied_head"].append((0, tensor))
            continue
        slot = layout.get(tensor.name)
        if slot is None or not slot.param.endswith(".weight"):
            continue
        owner = slot.param.removesuffix(".weight")
        if isinstance(modules.get(owner), Linear):
            parts[owner].append((slot.start, tensor))
    for found in parts.values():
        found.sort(key=lambda p: p[0])
    return parts


def _repackable(layer: Linear, found: list[tuple[int, GGUFTensor]]) -> bool:
    kinds = [t.ggml_type.name for _, t in found]
    rows = sum(t.shape[0] for _, t in found)
    groups = {GROUP.get(kind, BLOCK) for kind in kinds}
    # a fused projection may mix types (Q4_K_M files keep q, k as Q5_0 and v as Q8_0):
    # fine when the parts decode to one method, i.e. the same group and min or no min
    return not (any(k not in REPACKED_TYPES or layer.in_features % (SUPER if k.endswith("_K")
                                                                       else BLOCK)
                    for k in kinds)
                or rows != layer.out_features or len(groups) != 1
                or len({k in WITH_MIN for k in kinds}) != 1)


def gguf_repacked_tensors(model: nn.Module, gguf_file: Path) -> set[str]:
    """Checkpoint tensors (of the file's conversion) that repack_gguf_linears will replace by
    the file's blocks: the loader need not read their dequantized copies (model on meta)."""
    modules = dict(model.named_modules())
    return {t.name for owner, found in _parts_by_linear(model, gguf_file).items()
            if owner != "tied_head" and _repackable(modules[owner], found) for _, t in found}


def repack_gguf_linears(model: nn.Module, gguf_file: Path) -> tuple[int, list[str]]:
    """Swap the dense linears of `model` (loaded from `gguf_file`'s conversion) for the file's
    blocks where their type allows -> (layers repacked, names of those left dense)."""
    modules = dict(model.named_modules())
    repacked, dense = 0, []
    for owner, found in _parts_by_linear(model, gguf_file).items():
        layer = modules[owner]
        assert isinstance(layer, Linear)
        if not _repackable(layer, found):
            kinds = {t.ggml_type.name for _, t in found}
            dense.append(f"{owner} ({'/'.join(sorted(kinds))})")
            continue
        groups = {GROUP.get(t.ggml_type.name, BLOCK) for _, t in found}
        pieces = [decode_blocks(t.raw, t.ggml_type.name, layer.in_features) for _, t in found]
        layer.convert(method_for_blocks(pieces, groups.pop()))
        repacked += 1
    if dense:
        logger.info("--quantization gguf: %d linear layers keep dense weights (types without "
                    "a kernel): %s", len(dense), ", ".join(dense[:6]) +
                    (" ..." if len(dense) > 6 else ""))
    return repacked, dense
