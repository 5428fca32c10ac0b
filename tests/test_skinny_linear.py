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
    method = SkinnyF32Method()
    layer.convert(method)
    method._onednn = (False, False)  # (whatever this machine measured)
    torch.testing.assert_close(layer(x[:8]), want[:8], rtol=1e-5, atol=1e-5)
    assert torch.equal(layer(x), want)  # 20 tokens: F.linear itself
    assert layer.weight_bytes() == 40 * 24 * 4


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
@pytest.mark.parametrize("buckets", [(True, False), (False, True), (True, True)])
def test_wider_steps_take_onednn_where_chosen(buckets: tuple[bool, bool]) -> None:
    """Steps past the skinny kernel take oneDNN's GEMM in the buckets chosen for it (up to
    WIDE_ROWS rows, more), F.linear in the others; oneDNN's results against float64."""
    gen = torch.Generator().manual_seed(7)
    layer = Linear.from_weight(torch.randn(70, 96, generator=gen), torch.randn(70, generator=gen))
    method = SkinnyF32Method()
    layer.convert(method)
    method._onednn = buckets
    for rows in (17, SkinnyF32Method.WIDE_ROWS, SkinnyF32Method.WIDE_ROWS + 1, 300):
        x = torch.randn(rows, 96, generator=gen)
        plain = torch.nn.functional.linear(x, layer.weight, layer.bias)
        got = layer(x)
        if buckets[rows > SkinnyF32Method.WIDE_ROWS]:
            want = torch.nn.functional.linear(x.double(), layer.weight.double(),
                                              layer.bias.double())
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4 * 96**0.5)
        else:
            assert torch.equal(got, plain)


def test_the_onednn_choice_is_measured_once_per_shape_and_bucket(monkeypatch: object) -> None:
    asked: list[str] = []

    def remembered(question: str, measure: object) -> bool:
        asked.append(question)
        return "at 64 rows" in question

    monkeypatch.setattr(native, "remembered", remembered)  # type: ignore[attr-defined]
    method = SkinnyF32Method()
    Linear.from_weight(torch.randn(12, 32)).convert(method)
    assert asked == ["onednn-f32 12x32 at 64 rows", "onednn-f32 12x32 at 512 rows"]
    assert method._onednn == (True, False)


def _methods(runner: object) -> set[str]:
    model = runner.model  # type: ignore[attr-defined]
    return {type(m.method).__name__ for m in model.modules() if isinstance(m, Linear)}


def test_linear_kernel_choice_is_the_users_or_the_machines(llama_dir: object) -> None:
    from tests.model_helpers import make_runner

    assert _methods(make_runner(llama_dir, dtype="float32", linear_kernel="torch")) == \
        {"DenseMethod"}
    assert _methods(make_runner(llama_dir, dtype="float32", linear_kernel="native")) == \
        {"SkinnyF32Method"}
    with pytest.raises(ValueError, match="linear_kernel"):
        make_runner(llama_dir, dtype="float32", linear_kernel="fast")
    with pytest.raises(ValueError, match="linear_kernel native"):
        make_runner(llama_dir, dtype="float32", linear_kernel="native", quantization="int8")


_ASK = """
import random, sys, time
from pathlib import Path
from banyan.kernels import native
native.load()
native._cache_dir = lambda: Path(sys.argv[1])
measured = []
def measure():
    measured.append(1)
    time.sleep(0.2)
    return random.random() < 0.5
answer = native.remembered("question", measure)
print(answer, len(measured))
"""


def test_processes_started_together_take_one_answer(tmp_path: object) -> None:
    """The timing-based kernel choice is made once per machine: replicas started together must
    not each time it and pick differently (their outputs would differ in the last bits)."""
    import subprocess
    import sys

    procs = [subprocess.Popen([sys.executable, "-c", _ASK, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len({answer for answer, _ in outs}) == 1, outs
    assert sorted(n for _, n in outs) == ["0", "0", "0", "1"], outs  # one process measured
