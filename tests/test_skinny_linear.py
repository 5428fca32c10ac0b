"""The native skinny linear (banyan/kernels/cpu_skinny_linear.cpp), float32 and bf16, against
F.linear in float64: odd shapes, 1..12 tokens (more than one block of 8), with and without bias;
the methods that call it and how the runner picks them."""

from __future__ import annotations

import pytest
import torch

from banyan.kernels import choices, native
from banyan.layers.f32_linear import SkinnyF32Method
from banyan.layers.linear import (Linear, PackedBf16Method, PairsBf16Method,
                                  SkinnyBf16Method)
from banyan.layers.linear_choice import CHOICE_RULE
from banyan.layers.panels import pack_bf16_pairs

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


@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 5, 6, 7, 8, 9, 16])
@pytest.mark.parametrize("n,k", [(1, 1), (7, 13), (5, 33), (64, 576), (131, 1000)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_matches_float64_rounded_once(tokens: int, n: int, k: int, bias: bool) -> None:
    """bf16 inputs, float32 sums, one rounding to bf16 per output: within one bf16 step of the
    exact result (sizes off the 32-value blocks and odd row counts take the tails)."""
    gen = torch.Generator().manual_seed(tokens * 1000 + n + k)
    x = torch.randn(tokens, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    want = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    got = native.skinny_linear(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, n)
    torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-5 * k**0.5)
    # and as close to the exact value as oneDNN's bf16 GEMM gets (it, too, rounds once)
    library = torch.nn.functional.linear(x, w, b).double()
    assert (got.double() - want).abs().max() <= (library - want).abs().max() + 1e-5 * k**0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_values_whatever_the_thread_count(dtype: torch.dtype) -> None:
    """The rows are split across the threads and each output is one row's own sum, so every
    thread count gives the same bits, and no row is left out (131 rows: a split with a remainder
    at every block width)."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(131, 200, generator=gen).to(dtype)
    before = torch.get_num_threads()
    try:
        for tokens in (1, 5, 8):
            x = torch.randn(tokens, 200, generator=gen).to(dtype)
            results = []
            for threads in (1, 2, 3, 7):
                torch.set_num_threads(threads)
                results.append(native.skinny_linear(x, w, None))
            assert all(torch.equal(r, results[0]) for r in results)
            want = torch.nn.functional.linear(x.double(), w.double())
            torch.testing.assert_close(results[0].double(), want, rtol=2**-7, atol=1e-3)
    finally:
        torch.set_num_threads(before)


_PACKS = PackedBf16Method.available(torch.device("cpu"), torch.bfloat16)


@pytest.mark.skipif(not _PACKS, reason="no oneDNN bf16 packing in this torch")
def test_the_bf16_method_keeps_the_plain_weight_for_few_tokens_at_an_odd_width() -> None:
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(40, 23, generator=gen).bfloat16()  # the GEMM reads inputs in pairs
    bias = torch.randn(40, generator=gen).bfloat16()
    packed, skinny = Linear.from_weight(weight, bias), Linear.from_weight(weight, bias)
    packed.convert(PackedBf16Method())
    skinny.convert(SkinnyBf16Method())
    assert torch.equal(skinny.weight, weight) and skinny.weight_bytes() == 40 * 23 * 2
    x = torch.randn(20, 23, generator=gen).bfloat16()
    few = SkinnyBf16Method.SKINNY_ROWS
    assert torch.equal(skinny(x[:few]), native.skinny_linear(x[:few].contiguous(), weight, bias))
    assert torch.equal(skinny(x), packed(x))  # wider: oneDNN's GEMM on the packed copy
    native_linear = skinny.method.native(skinny)
    assert native_linear is not None and native_linear.kind == "skinny_bf16"


@pytest.mark.skipif(not _PACKS, reason="no oneDNN bf16 packing in this torch")
def test_a_plain_bf16_weight_gives_each_token_of_a_check_its_bits_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the plain weight serves (odd widths), steps of up to 16 tokens (a speculative
    check's) take the skinny kernel, whose tokens come out as each would alone: the check
    computes every token as its decode did."""
    if not SkinnyBf16Method.suits_here():
        pytest.skip("the skinny bf16 kernel needs AVX512-BF16")
    monkeypatch.setattr(SkinnyBf16Method, "takes_gemm", classmethod(lambda cls, layer: False))
    assert SkinnyBf16Method.SKINNY_ROWS >= 16
    gen = torch.Generator().manual_seed(5)
    layer = Linear.from_weight(torch.randn(70, 256, generator=gen).bfloat16(),
                               torch.randn(70, generator=gen).bfloat16())
    layer.convert(SkinnyBf16Method())
    assert not hasattr(layer, "pairs")
    x = torch.randn(16, 256, generator=gen).bfloat16()
    whole = layer(x)
    for t in range(16):
        assert torch.equal(whole[t:t + 1], layer(x[t:t + 1]))


@pytest.mark.skipif(not _PACKS, reason="no oneDNN bf16 packing in this torch")
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_bf16_layer_keeps_its_pairs_for_up_to_gemm_rows_tokens(with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(40, 24, generator=gen).bfloat16()
    bias = torch.randn(40, generator=gen).bfloat16() if with_bias else None
    layer, packed = Linear.from_weight(weight, bias), Linear.from_weight(weight, bias)
    layer.convert(SkinnyBf16Method())
    packed.convert(PackedBf16Method())
    if not SkinnyBf16Method.takes_gemm(layer):  # no vdpbf16ps here: the plain weight
        assert torch.equal(layer.weight, weight) and not hasattr(layer, "pairs")
        return
    assert not hasattr(layer, "weight")  # the pairs replace the plain copy
    assert torch.equal(layer.pairs, pack_bf16_pairs(weight))
    spec = layer.method.native(layer)
    assert spec is not None and spec.kind == "pairs_bf16" and spec.weight is layer.pairs
    rows = SkinnyBf16Method.GEMM_ROWS
    x = torch.randn(rows + 3, 24, generator=gen).bfloat16()
    for tokens in (1, 3, 8, 9, rows):  # the one kernel: each token's bits whatever the batch
        got = layer(x[:tokens])
        if bias is None:
            assert torch.equal(got, native.bf16_gemm(x[:tokens].contiguous(), weight))
        else:  # added in float32 before the one rounding, as the skinny kernel adds it
            want = native.skinny_linear(x[:tokens].contiguous(), weight, bias)
            assert (got.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max()
            assert layer.pairs_bias.dtype == torch.float32
        assert torch.equal(got, layer(x[:rows])[:tokens])
    assert torch.equal(layer(x), packed(x))  # past GEMM_ROWS: oneDNN's GEMM on the packed copy


def test_the_bf16_plain_copy_needs_memory_to_spare() -> None:
    import os

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert SkinnyBf16Method.affordable(total // SkinnyBf16Method.MEMORY_SHARE)
    assert not SkinnyBf16Method.affordable(total // SkinnyBf16Method.MEMORY_SHARE + 1)


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

    monkeypatch.setattr(choices, "remembered", remembered)  # type: ignore[attr-defined]
    method = SkinnyF32Method()
    Linear.from_weight(torch.randn(12, 32)).convert(method)
    assert asked == [f"onednn-f32 12x32 at 64 rows{CHOICE_RULE}",
                     f"onednn-f32 12x32 at 512 rows{CHOICE_RULE}"]
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
    if _PACKS:
        assert _methods(make_runner(llama_dir, dtype="bfloat16", linear_kernel="torch")) == \
            {"PackedBf16Method"}
        runner = make_runner(llama_dir, dtype="bfloat16", linear_kernel="native")
        head = runner.model.tied_head or runner.model.lm_head  # outside the layer stack
        # one copy of the head: in the bf16 GEMM's pairs where its layers' steps take them
        want = "PairsBf16Method" if SkinnyBf16Method.takes_gemm(head) else "PackedBf16Method"
        assert _methods(runner) == {"SkinnyBf16Method", want}
        assert type(head.method).__name__ == want


@pytest.mark.skipif(not native.bf16_gemm_here(), reason="the bf16 GEMM kernel needs AVX512-BF16")
def test_a_pairs_head_gives_each_row_the_same_bits_whatever_the_step() -> None:
    """The LM head in pairs alone: logits within bf16 rounding of a float64 product, and each
    row's the very bits it gets alone, in a batch or as part of a long step (past GEMM_ROWS)."""
    torch.manual_seed(3)
    w, bias = torch.randn(200, 64).bfloat16(), torch.randn(200).bfloat16()
    layer = Linear.from_weight(w.clone(), bias.clone())
    layer.convert(PairsBf16Method())
    assert not hasattr(layer, "weight") and layer.weight_bytes() == 200 * 64 * 2
    x = torch.randn(300, 64).bfloat16()
    got = layer(x)
    want = x.double() @ w.double().T + bias.double()
    assert ((got.double() - want).abs() <= 2**-8 * want.abs() + 1e-3).all()
    for rows in (slice(0, 1), slice(5, 9), slice(40, 104)):
        assert torch.equal(layer(x[rows]), got[rows])


_ASK = """
import random, sys, time
from pathlib import Path
from banyan.kernels import choices, native
native.load()
native.cache_dir = lambda: Path(sys.argv[1])
measured = []
def measure():
    measured.append(1)
    time.sleep(0.2)
    return random.random() < 0.5
answer = choices.remembered("question", measure)
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


@pytest.mark.skipif(not _PACKS, reason="no oneDNN bf16 packing in this torch")
def test_bf16_auto_takes_the_kernel_with_vdpbf16ps_and_memory_to_spare(
        llama_dir: object, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.model_helpers import make_runner

    monkeypatch.setattr(SkinnyBf16Method, "suits_here", staticmethod(lambda: True))
    runner = make_runner(llama_dir, dtype="bfloat16")
    head = runner.model.tied_head or runner.model.lm_head
    assert _methods(runner) == {"SkinnyBf16Method", "PairsBf16Method"
                                if SkinnyBf16Method.takes_gemm(head) else "PackedBf16Method"}
    monkeypatch.setattr(SkinnyBf16Method, "MEMORY_SHARE", 10**12)  # no copy is affordable
    assert _methods(make_runner(llama_dir, dtype="bfloat16")) == {"PackedBf16Method"}
    monkeypatch.setattr(SkinnyBf16Method, "MEMORY_SHARE", 8)
    monkeypatch.setattr(SkinnyBf16Method, "suits_here", staticmethod(lambda: False))
    assert _methods(make_runner(llama_dir, dtype="bfloat16")) == {"PackedBf16Method"}
