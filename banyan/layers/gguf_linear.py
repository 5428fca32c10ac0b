"""`--quantization gguf`: the linear layers of a GGUF model computed from the file's own blocks.

A GGUF model loads dequantized (models/gguf_loader.py converts it once into a float checkpoint);
with this mode each linear layer whose file tensor is Q8_0, Q4_0 or Q4_1 then swaps its dense
weight for those blocks, repacked into the CPU kernels' panel layout without changing a value:

- Q4_1 (32 inputs: float16 d and m, 4-bit q): value = q * d + m, which is exactly `Int4Method`'s
  format (codes, a float16 scale and minimum per 32 inputs);
- Q4_0 (float16 d, 4-bit q): value = (q - 8) * d = q * d + (-8 d), the same with minimum -8 d
  (exact in float16: a power-of-two multiple);
- Q8_0 (float16 d, int8 q): value = q * d, `GroupInt8Method` (cpu_int8g_linear.cpp) with the
  scale widened to float32.

So the repacked layer computes with exactly the values transformers dequantizes (tested bit for
bit), reading 0.56-1.13 bytes per weight instead of 4. A tied LM head takes the embedding's
blocks; the embedding itself stays dense for lookups (a step reads a few of its rows). Tensors
of other types (the K-quants, Q5_*) and fused layers whose parts differ in type stay dense, and
the log says which.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from torch import nn

from banyan.layers.linear import Linear
from banyan.layers.quant import Int4Method, _from_panels, _pad_rows, _QuantMethod, _to_panels

logger = logging.getLogger(__name__)

BLOCK = 32  # inputs per block of Q8_0, Q4_0, Q4_1
REPACKED_TYPES = ("Q8_0", "Q4_0", "Q4_1")


def decode_blocks(raw: np.ndarray, ggml_type: str, cols: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """raw uint8 [rows, bytes] blocks of one tensor -> (codes [rows, cols], scale
    [rows, cols / 32], min [rows, cols / 32] or None): Q4_x codes uint8 0..15 with float16
    scale and min; Q8_0 codes int8 with a float32 scale and no min."""
    rows, nb = raw.shape[0], cols // BLOCK
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
        layer.codes = _to_panels(_pad_rows(codes))
        layer.scale = _to_panels(_pad_rows(scale.float()))

    def _kernel(self, layer: Linear, flat: torch.Tensor, out: torch.Tensor) -> None:
        self._lib().banyan_int8g_linear_f32(
            flat.data_ptr(), flat.shape[0], layer.in_features, self.group,
            layer.codes.data_ptr(), layer.scale.data_ptr(), self._bias_ptr(layer),
            out.data_ptr(), layer.out_features, torch.get_num_threads())

    def _dequantize(self, layer: Linear, p0: int, p1: int, out: torch.Tensor) -> None:
        self._lib().banyan_int8g_dequant_f32(
            layer.codes.data_ptr(), layer.scale.data_ptr(), layer.in_features, self.group, p0,
            p1, out.data_ptr(), torch.get_num_threads())

    def weight_bytes(self, layer: Linear) -> int:
        return layer.out_features * (layer.in_features + 4 * (layer.in_features // self.group))

    def dequantized_weight(self, layer: Linear) -> torch.Tensor:
        codes = _from_panels(layer.codes, layer.out_features).float()
        scale = _from_panels(layer.scale, layer.out_features)
        return codes * scale.repeat_interleave(self.group, dim=1)


def method_for_blocks(pieces: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
                      ) -> _QuantMethod:
    """The method computing with these decoded blocks (the parts of one layer, in row order)."""
    codes = torch.cat([p[0] for p in pieces])
    scale = torch.cat([p[1] for p in pieces])
    if pieces[0][2] is None:
        return GroupInt8Method(codes, scale)
    low = torch.cat([p[2] for p in pieces if p[2] is not None])
    return Int4Method(BLOCK, given=(codes, scale, low))


def repack_gguf_linears(model: nn.Module, gguf_file: Path) -> tuple[int, list[str]]:
    """Swap the dense linears of `model` (loaded from `gguf_file`'s conversion) for the file's
    blocks where their type allows -> (layers repacked, names of those left dense)."""
    from banyan.models.gguf_loader import iter_gguf_tensors, open_gguf

    modules = dict(model.named_modules())
    layout = model.checkpoint_layout()
    parts: dict[str, list[tuple[int, object]]] = defaultdict(list)
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
    repacked, dense = 0, []
    for owner, found in parts.items():
        layer = modules[owner]
        assert isinstance(layer, Linear)
        found.sort(key=lambda p: p[0])
        kinds = {t.ggml_type.name for _, t in found}  # type: ignore[attr-defined]
        kind = next(iter(kinds))
        rows = sum(t.shape[0] for _, t in found)  # type: ignore[attr-defined]
        if len(kinds) != 1 or kind not in REPACKED_TYPES or rows != layer.out_features or \
                layer.in_features % BLOCK:
            dense.append(f"{owner} ({'/'.join(sorted(kinds))})")
            continue
        pieces = [decode_blocks(t.raw, kind, layer.in_features)  # type: ignore[attr-defined]
                  for _, t in found]
        layer.convert(method_for_blocks(pieces))
        repacked += 1
    if dense:
        logger.info("--quantization gguf: %d linear layers keep dense weights (types without "
                    "a kernel): %s", len(dense), ", ".join(dense[:6]) +
                    (" ..." if len(dense) > 6 else ""))
    return repacked, dense
