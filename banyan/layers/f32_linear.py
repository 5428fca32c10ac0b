"""The float32 linear method on CPU: the native skinny kernel for short steps, and per weight
shape the faster of MKL's and oneDNN's GEMMs for longer ones, each choice measured once per
machine (linear_choice). Apart from linear.py, which holds the layer and the bf16 methods."""

from __future__ import annotations

import torch
from torch import nn

from banyan.kernels import choices, native
from banyan.layers.linear import DenseMethod, Linear, NativeLinear
from banyan.layers.linear_choice import CHOICE_RULE, beats_linear


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                  ) -> torch.Tensor:
    """x @ weight.T + bias through oneDNN (the op PackedBf16Method calls, given the plain
    weight: oneDNN reads the row-major matrix as it is)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


class SkinnyF32Method(DenseMethod):
    """float32 on CPU: steps of up to SKINNY_ROWS tokens go through the native skinny kernel,
    which reads each weight row once for all of them (a decode checking speculative guesses, a
    small batch); more tokens go to F.linear. The weight stays as it is (no copy). oneDNN and MKL
    switch from a GEMV to a GEMM kernel from two rows on, which measured ~2x a GEMV on both 2-core
    machines seen (Zen 3: the LM head 9.0 ms at one row, 20 ms at 2-8 rows; the kernel 5.1-5.8
    ms), so checking guesses was not free. Sums are in another order than F.linear's (8-lane
    partial sums): results differ in the last bits (~1e-6 relative). Up to 16 tokens the kernel
    measured faster on every projection of SmolLM2 there (two passes over the weights beat the
    GEMM); past that, F.linear. Whether it wins on a CPU is measured (`faster_here`) once per
    machine (`chosen_here`), so every process serving a model computes it alike.

    Wider steps: F.linear's float32 GEMM is MKL's, and on Zen 3 oneDNN's (the same call bf16
    takes, here on the plain weight: no packed copy) measured 1.2-1.8x faster at 32-64 rows for
    most of SmolLM2's projections (the LM head at 64 rows: 64 -> 35 ms) and within +-15% at
    512-2,048. So each weight shape takes, per bucket (up to WIDE_ROWS rows: decode batches;
    more: prefill chunks), oneDNN where it measured clearly faster here (`onednn_chosen_here`,
    by CHOICE_MARGIN; remembered per machine like the skinny choice). Sums differ in the last
    bits (~1e-6).
    """

    SKINNY_ROWS = 16
    can_be_batch_invariant = True  # (the skinny kernel: passes of 8 tokens, each alone's bits)
    WIDE_ROWS = 128  # the bucket edge between decode batches and prefill chunks
    BUCKET_PROBES = (64, 512)  # rows each bucket is measured at

    def __init__(self) -> None:
        self._onednn = (False, False)  # per bucket: oneDNN's GEMM instead of F.linear

    def create_weights(self, layer: Linear) -> None:
        raise NotImplementedError("made from a loaded dense layer (adopt)")

    def adopt(self, layer: Linear) -> None:
        layer.weight.data = layer.weight.data.contiguous()
        if torch.backends.mkldnn.is_available():
            self._onednn = tuple(  # type: ignore[assignment]
                self.onednn_chosen_here(layer.weight, rows) for rows in self.BUCKET_PROBES)

    def native(self, layer: Linear) -> NativeLinear | None:
        return NativeLinear("skinny_f32", layer.weight)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            rows = x.shape[0]
            if rows <= self.SKINNY_ROWS or self.batch_invariant:
                return native.skinny_linear(x.contiguous(), layer.weight, layer.bias)
            if self._onednn[rows > self.WIDE_ROWS]:
                return onednn_linear(x, layer.weight, layer.bias)
        return nn.functional.linear(x, layer.weight, layer.bias)

    @staticmethod
    def available(device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cpu" and dtype == torch.float32 and native.load() is not None

    @classmethod
    def chosen_here(cls, weight: torch.Tensor) -> bool:
        """`faster_here` for this weight's shape, as first measured on this machine."""
        rows, cols = weight.shape
        return choices.remembered(f"skinny-f32 {rows}x{cols}{CHOICE_RULE}",
                                 lambda: cls.faster_here(weight))

    @classmethod
    def faster_here(cls, weight: torch.Tensor, rows: int = 4, reps: int = 3) -> bool:
        """Whether the kernel beats F.linear on this CPU for `rows` tokens through `weight` (the
        model's largest, where the time goes). CPUs differ (GEMM libraries pick other kernels
        per ISA), so this is measured, not assumed."""
        return beats_linear("skinny float32 linear", native.skinny_linear, weight, rows, reps)

    @classmethod
    def onednn_chosen_here(cls, weight: torch.Tensor, rows: int) -> bool:
        """Whether oneDNN's float32 GEMM beats F.linear for `rows` tokens through this weight's
        shape, as first measured on this machine."""
        out_f, in_f = weight.shape
        return choices.remembered(
            f"onednn-f32 {out_f}x{in_f} at {rows} rows{CHOICE_RULE}",
            lambda: beats_linear("oneDNN float32 linear", onednn_linear, weight, rows,
                                  reps=1 if out_f * in_f * rows > 2**30 else 3))
