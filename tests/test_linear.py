"""Linear layers with a method and per-parameter weight loaders."""

from __future__ import annotations

import pytest
import torch

from banyan.layers.linear import (
    DenseMethod,
    Linear,
    PackedBf16Method,
    dense_weight_loader,
    model_weight_bytes,
)


def test_dense_loader_places_fused_parts_and_names_bad_shapes() -> None:
    layer = Linear(4, 6, bias=True)
    q, k = torch.arange(16.0).view(4, 4), -torch.arange(8.0).view(2, 4)
    layer.weight.weight_loader(layer.weight, q, 0, 4)
    layer.weight.weight_loader(layer.weight, k, 4, 2)
    assert torch.equal(layer.weight, torch.cat([q, k]))
    with pytest.raises(ValueError, match=r"shape \(3, 4\), the config expects \(2, 4\)"):
        dense_weight_loader(layer.weight, torch.ones(3, 4), 4, 2)
    layer.bias.weight_loader(layer.bias, torch.ones(6))
    x = torch.randn(3, 4)
    assert torch.allclose(layer(x), x @ layer.weight.T + 1)
    assert isinstance(layer.method, DenseMethod) and layer.weight_bytes() == 6 * 4 * 4


def test_packed_method_same_result_and_bytes() -> None:
    if not PackedBf16Method.available(torch.device("cpu"), torch.bfloat16):
        pytest.skip("this torch build has no oneDNN weight packing")
    w, b = torch.randn(24, 16).bfloat16(), torch.randn(24).bfloat16()
    layer = Linear.from_weight(w, b)
    x = torch.randn(5, 16).bfloat16()
    with torch.inference_mode():
        want = layer(x)
        dense_bytes = layer.weight_bytes()
        layer.convert(PackedBf16Method())
        assert torch.equal(layer(x), want)
    assert not hasattr(layer, "weight") and layer.weight_bytes() == dense_bytes == 24 * 16 * 2
    # the weight read back through the packed GEMM (the draft's head is made from it), bias aside
    assert torch.equal(layer.method.dequantized_weight(layer), w.float())


def test_model_weight_bytes_counts_each_weight_once() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), Linear(4, 8), torch.nn.LayerNorm(8))
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert model_weight_bytes(model) == total
    assert model_weight_bytes(model, skip=(model[1],)) == total - 8 * 4 * 4
