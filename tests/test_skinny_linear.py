"""The native skinny float32 linear (banyan/kernels/cpu_skinny_linear.cpp) against F.linear in
float64: odd shapes, 1..12 tokens (more than one block of 8), with and without bias."""

from __future__ import annotations

import pytest
import torch

from banyan.kernels import native
from banyan.layers.linear import Linear, SkinnyF32Method

pytestmark = pytest.mark.skipif(native.load() is None, reason="native kernels do not build here")


@pytest.mark.parametrize("tokens", [1, 2, 3, 5, 8, 9, 12])
@pytest.mark.parametrize("n,k", [(1, 1), (7, 13), (64, 576), (130, 1000)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64(tokens: int, n: int, k: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(tokens * 1000 + n + k)
    x = torch.randn(tokens, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    want = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    got = native.skinny_linear(x, w, b)
    assert got.dtype == torch.float32 and got.shape == (tokens, n)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4 * k**0.5)


def test_the_method_takes_few_tokens_and_leaves_the_rest_to_f_linear() -> None:
    layer = Linear.from_weight(torch.randn(40, 24), torch.randn(40))
    x = torch.randn(20, 24)
    want = torch.nn.functional.linear(x, layer.weight, layer.bias)
    layer.convert(SkinnyF32Method())
    torch.testing.assert_close(layer(x[:8]), want[:8], rtol=1e-5, atol=1e-5)
    assert torch.equal(layer(x), want)  # 20 tokens: F.linear itself
    assert layer.weight_bytes() == 40 * 24 * 4
