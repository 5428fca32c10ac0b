"""`--activation-quant int8` (layers/int8_activations.py, kernels/cpu_int8act_linear.cpp): the
activation quantization is reproduced exactly, every weight format's kernel matches a float64
product of the same quantized activations and the dequantized weights (odd shapes, 1 to 130
rows; the AVX2 build and the portable loops alike), the repacking keeps the weights' values,
the layer stack equals the per-op model, the engine makes text with logits near the float
path's, and the flag is refused at startup where there is nothing to quantize."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from banyan import Engine, SamplingParams
from banyan.args import EngineArgs
from banyan.kernels import native
from banyan.layers.gguf_linear import GroupInt8Method
from banyan.layers.int8_activations import (Int8ActivationMethod, check_activation_quant,
                                            enable_int8_activations)
from banyan.layers.linear import Linear
from banyan.layers.quant import Int4Method, Int8Method
from banyan.mem.allocator import SlotAllocator
from banyan.runner.model_runner import ModelRunner
from tests.model_helpers import Seq, make_runner, random_ids, run_step

pytestmark = pytest.mark.skipif(native.load() is None, reason="native CPU kernels unavailable")
Lib = ctypes.CDLL
ROWS = [1, 3, 5, 6, 7, 12, 64]  # partial blocks of AVX2's 4 and AVX-512's 8 tokens


def quantize_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x float32 [T, K] -> (q int8 [T, K], d float32 [T, K / 32]) as the kernel makes them:
    d = max|x| / 127 per 32 inputs, q = x * (1 / d) rounded half to even (0 for a zero block)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1) / 127.0
    inv = torch.where(d > 0, torch.ones_like(d) / d.clamp(min=1e-38), torch.zeros_like(d))
    q = torch.round(blocks * inv[..., None]).clamp(-127, 127)
    return q.reshape(x.shape).to(torch.int8), d


def _kernel_quantize(lib: Lib, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.empty(x.shape, dtype=torch.int8)
    d = torch.empty(x.shape[0], x.shape[1] // 32)
    lib.banyan_q8_quantize_f32(x.data_ptr(), x.shape[0], x.shape[1], q.data_ptr(), d.data_ptr())
    return q, d


def _activations(tokens: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g) * torch.rand(tokens, k // 32, 1, generator=g).repeat(
        1, 1, 32).reshape(tokens, k) * 4
    x[0, :32] = 0.0  # a zero block: scale 0, codes 0
    if k >= 64:  # exact ties: max 127 makes 1 / d = 1, so x.5 rounds half to even
        x[-1, 32:64] = torch.arange(32) - 15.5
        x[-1, 63] = 127.0
    return x


def test_activation_quantization_is_reproduced_exactly() -> None:
    lib = native.load()
    for tokens, k in ((1, 32), (5, 96), (64, 576)):
        x = _activations(tokens, k, tokens + k)
        q, d = _kernel_quantize(lib, x)
        want_q, want_d = quantize_reference(x)
        assert torch.equal(q, want_q) and torch.equal(d, want_d)
    assert q.abs().max() == 127


def _int4_given(out_f: int, in_f: int, group: int, wide: bool,
                seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out_f, in_f), generator=g, dtype=torch.uint8)
    scale = torch.rand(out_f, in_f // group, generator=g) * 0.02 + 1e-3
    low = -torch.rand(out_f, in_f // group, generator=g) * 0.1
    return (codes, scale, low) if wide else (codes, scale.half(), low.half())


# name -> (out, in, make the quantized layer)
FORMATS: dict[str, Callable[[int, int], Linear]] = {}


def _format(name: str) -> Callable[[Callable[[int, int], Linear]], Callable[[int, int], Linear]]:
    def register(fn: Callable[[int, int], Linear]) -> Callable[[int, int], Linear]:
        FORMATS[name] = fn
        return fn
    return register


def _dense(out_f: int, in_f: int, bias: bool = True) -> Linear:
    g = torch.Generator().manual_seed(out_f * 1000 + in_f)
    return Linear.from_weight(torch.randn(out_f, in_f, generator=g) * 0.1,
                              torch.randn(out_f, generator=g) if bias else None)


@_format("int8 rows")
def _int8_rows(out_f: int, in_f: int) -> Linear:
    layer = _dense(out_f, in_f)
    layer.convert(Int8Method())
    return layer


for _group in (32, 64, 128):
    @_format(f"int4 g{_group}")
    def _int4(out_f: int, in_f: int, group: int = _group) -> Linear:
        layer = _dense(out_f, in_f, bias=group != 64)
        layer.convert(Int4Method(group))
        return layer


@_format("int4 symmetric (Q4_0)")
def _int4_symmetric(out_f: int, in_f: int) -> Linear:
    """GGUF's Q4_0: value (q - 8) d, i.e. min = -8 d exactly: the kernels read no minimums."""
    codes, scale, _ = _int4_given(out_f, in_f, 32, False, in_f + 2)
    layer = _dense(out_f, in_f)
    layer.convert(Int4Method(32, given=(codes, scale, scale * -8)))
    return layer


@_format("int4 float32 scales (Q4_K)")
def _int4_wide(out_f: int, in_f: int) -> Linear:
    layer = _dense(out_f, in_f)
    layer.convert(Int4Method(32, given=_int4_given(out_f, in_f, 32, True, in_f)))
    return layer


for _group, _span in ((32, 127), (16, 32)):  # Q8_0; Q6_K's 16-input groups of -32..31
    @_format(f"int8 g{_group}")
    def _int8g(out_f: int, in_f: int, group: int = _group, span: int = _span) -> Linear:
        g = torch.Generator().manual_seed(in_f)
        codes = torch.randint(-span, span, (out_f, in_f), generator=g).to(torch.int8)
        codes[0, :4] = torch.tensor([-128, 127, -128, 127]) if span == 127 else codes[0, :4]
        scale = torch.rand(out_f, in_f // group, generator=g) * 0.01
        layer = _dense(out_f, in_f, bias=False)
        layer.convert(GroupInt8Method(codes, scale, group))
        return layer


@_format("int5 (Q5_0)")
def _int5(out_f: int, in_f: int) -> Linear:
    g = torch.Generator().manual_seed(in_f + 1)
    codes = torch.randint(-16, 16, (out_f, in_f), generator=g).to(torch.int8)
    scale = (torch.rand(out_f, in_f // 32, generator=g) * 0.05).half().float()  # as Q5_0's d
    layer = _dense(out_f, in_f)
    layer.convert(GroupInt8Method(codes, scale, 32))
    return layer


def _want(layer: Linear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (product, sum of the magnitudes of its terms) over the quantized activations."""
    q, d = quantize_reference(x)
    xq = (q.double().reshape(x.shape[0], -1, 32) * d.double()[..., None]).reshape(x.shape)
    w = layer.method.dequantized_weight(layer).double()
    want = xq @ w.T
    if layer.bias is not None:
        want += layer.bias.double()
    return want, xq.abs() @ w.abs().T


def _check(layer: Linear, tokens: int, run: Callable[[Linear, torch.Tensor], torch.Tensor],
           seed: int) -> None:
    x = _activations(tokens, layer.in_features, seed)
    want, magnitude = _want(layer, x)
    got = run(layer, x)
    assert got.shape == want.shape
    # float32 sums of a few terms per 32-input block: far below a code's step
    assert ((got.double() - want).abs() <= 1e-5 * magnitude + 1e-6).all()


def _through_method(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    return layer(x)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("out_f,in_f", [(1, 128), (37, 256), (200, 384)])
def test_kernel_matches_float64_of_the_quantized_activations(fmt: str, out_f: int,
                                                             in_f: int) -> None:
    layer = FORMATS[fmt](out_f, in_f)
    enable_int8_activations(layer)
    assert isinstance(layer.method, Int8ActivationMethod)
    assert layer.method.kind == ("int4_wide" if "Q4_K" in fmt else fmt[:4])
    # minimums read from memory only where they are not a fixed multiple of the scale
    assert (layer.method.mins is None) == ("Q4_0" in fmt or "Q5_0" in fmt or "int8" in fmt)
    for tokens in ROWS:
        _check(layer, tokens, _through_method, tokens)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_bf16_in_and_out_equals_the_float32_entry_between_roundings(fmt: str) -> None:
    """A bf16 model's steps (the layer stack's too) take the kernels' bf16 entry: the bits of
    the float32 entry on the widened x, its output rounded to bf16."""
    layer = FORMATS[fmt](200, 384)
    enable_int8_activations(layer)
    for tokens in (1, 3, 17):
        x = (_activations(tokens, layer.in_features, tokens) * 3).bfloat16()
        got = layer(x)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, layer(x.float()).bfloat16()), tokens


def test_bf16_outputs_round_ties_to_even() -> None:
    """Integer weights and activations with scales of exactly 1 make every output an exact
    integer sum, most past 256, where bf16's 8 bits leave many exactly halfway: the bf16 entry
    rounds each to even as torch does, with a bias, in a partial last panel, for the steps of
    the one-token loops and of the panels."""
    g = torch.Generator().manual_seed(5)
    weight = torch.randint(-127, 128, (200, 384), generator=g).float()
    weight[:, 0] = 127.0  # a row's largest magnitude 127: scale 1
    layer = Linear.from_weight(weight, bias=torch.randint(-3, 4, (200,), generator=g).float())
    layer.convert(Int8Method())
    enable_int8_activations(layer)
    for tokens in (1, 3, 17, 64):
        x = torch.randint(-127, 128, (tokens, 384), generator=g).float()
        x[:, ::32] = 127.0  # each block's largest 127: d = 1, codes = x
        exact = x.double() @ weight.double().T + layer.bias.double()
        assert torch.equal(layer(x).double(), exact), tokens  # every sum exact in float32
        halfway = (exact.abs() > 256) & (exact.remainder(2) == 1)
        assert halfway.float().mean() > 0.2, "few ties: the test would not see their rounding"
        assert torch.equal(layer(x.bfloat16()), exact.float().bfloat16()), tokens


@pytest.mark.parametrize("fmt", ["int4 g32", "int4 symmetric (Q4_0)", "int8 rows", "int8 g16",
                                 "int5 (Q5_0)"])
def test_wrapping_keeps_the_values_and_long_steps_take_the_kernel(fmt: str) -> None:
    """The repacked codes dequantize to the wrapped method's very weights, and prefill-sized
    steps (the float path's GEMM range) quantize their activations too."""
    layer = FORMATS[fmt](40, 128)
    before = layer.method.dequantized_weight(layer)
    enable_int8_activations(layer)
    assert torch.equal(layer.method.dequantized_weight(layer), before)
    assert not hasattr(layer, "codes")  # one copy of the codes: the new layout
    _check(layer, 130, _through_method, 5)


@pytest.fixture(scope="module")
def portable_lib(tmp_path_factory: pytest.TempPathFactory) -> Lib:
    """The kernels built without -march=native: the plain-loop path, as on a CPU without
    AVX2."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    src = Path(native.__file__).parent / "cpu_int8act_linear.cpp"
    out = tmp_path_factory.mktemp("portable") / "q8.so"
    flags = [f for f in native.FLAGS if not f.startswith("-march")]
    subprocess.run([compiler, *flags, "-march=x86-64", str(src), "-o", str(out)], check=True,
                   capture_output=True, timeout=300)
    lib = ctypes.CDLL(str(out))
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.banyan_q8_quantize_f32.argtypes = [ptr, i64, i64, ptr, ptr]
    for name in ("int4", "int4s", "int8", "int5"):  # as native.load() declares them
        fn = getattr(lib, f"banyan_q8_{name}_linear_f32")
        fn.argtypes = getattr(native.load(), f"banyan_q8_{name}_linear_f32").argtypes
        fn.restype = None
    return lib


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 flags")
@pytest.mark.parametrize("fmt", ["int8 rows", "int4 g64", "int4 float32 scales (Q4_K)",
                                 "int4 symmetric (Q4_0)", "int8 g16", "int5 (Q5_0)"])
def test_portable_loops_match_too(portable_lib: Lib, fmt: str,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    x = _activations(5, 256, 0)
    assert all(torch.equal(a, b) for a, b in zip(_kernel_quantize(portable_lib, x),
                                                 quantize_reference(x)))
    layer = FORMATS[fmt](37, 256)
    enable_int8_activations(layer)
    monkeypatch.setattr(native, "load", lambda: portable_lib)
    for tokens in (1, 6):
        _check(layer, tokens, _through_method, tokens)


def _logits(runner: ModelRunner, prompt: list[int], steps: int) -> torch.Tensor:
    """Logits of a prompt and a few decodes (the layer stack's steps)."""
    alloc = SlotAllocator(runner.num_slots)
    seq = Seq(0, prompt + random_ids(steps, 99))
    rows = run_step(runner, alloc, [(seq, len(prompt))])
    rows += [run_step(runner, alloc, [(seq, 1)])[0] for _ in range(steps)]
    return torch.cat(rows)


@pytest.mark.parametrize("quantization,arch", [("int4", "llama"), ("int8", "qwen3")])
def test_stack_and_logits(model_dirs: dict[str, Path], quantization: str, arch: str) -> None:
    """The layer stack runs the new kernels (hidden states equal to the per-op path, bit for
    bit), and the logits stay near the float-activation model's."""
    from banyan.models.native_stack import NativeLayerStack
    from tests.test_native_stack import _check_steps

    float_path = make_runner(model_dirs[arch], dtype="float32", quantization=quantization)
    runner = make_runner(model_dirs[arch], dtype="float32", quantization=quantization)
    enable_int8_activations(runner.model)
    runner.stack = NativeLayerStack.build(runner.model, runner.pool, runner.backend)
    assert runner.stack is not None
    prompt = random_ids(20, 7)
    want, got = _logits(float_path, prompt, 6), _logits(runner, prompt, 6)
    assert not torch.equal(got, want)
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    _check_steps(runner)


@pytest.mark.parametrize("wtype,kind", [("Q5_0", "int5"), ("Q4_K", "int4_wide"),
                                        ("Q8_0", "int8"), ("Q6_K", "int8"), ("Q4_0", "int4")])
def test_stack_on_gguf_blocks(tmp_path: Path, tokenizer_dir: Path, wtype: str, kind: str,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("gguf")
    from banyan.model_files import resolve_model_dir
    from banyan.models.native_stack import NativeLayerStack
    from tests.gguf_helpers import write_gguf
    from tests.test_native_stack import _check_steps

    monkeypatch.setenv("BANYAN_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "m.gguf", tokenizer_dir, "llama", wtype, tied=True)
    runner = make_runner(resolve_model_dir(str(path), show_progress=False), dtype="float32",
                         quantization="gguf", gguf_file=path)
    layers = [m for m in runner.model.modules() if isinstance(m, Linear)]
    before = [m.method.dequantized_weight(m) for m in layers]
    enable_int8_activations(runner.model)
    assert {m.method.kind for m in layers} == {kind}
    if wtype == "Q4_0":  # its minimum is -8 d: the kernels read none
        assert all(m.method.mins is None for m in layers)
    assert all(torch.equal(m.method.dequantized_weight(m), w) for m, w in zip(layers, before))
    runner.stack = NativeLayerStack.build(runner.model, runner.pool, runner.backend)
    assert runner.stack is not None
    _check_steps(runner)


def test_engine_makes_text_with_int8_activations(model_dirs: dict[str, Path]) -> None:
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    with Engine(str(model_dirs["qwen2"]), dtype="float32", device="cpu", disable_tqdm=True,
                quantization="int4", activation_quant="int8") as engine:
        out = engine.generate(input_ids=[random_ids(12, 3)], sampling_params=[params])[0]
        runner = engine.core.scheduler.runner.model_runner
        linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
        assert linears and all(isinstance(m.method, Int8ActivationMethod) for m in linears)
        assert runner.stack is not None
    assert len(out.output_ids) == 8


def test_startup_errors_name_the_flag(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="activation_quant must be one of"):
        EngineArgs(activation_quant="int4")
    with pytest.raises(ValueError, match="activation_quant int8 .* needs quantization"):
        EngineArgs(quantization="none", activation_quant="int8")
    with pytest.raises(ValueError, match="--activation-quant int8 .* needs --quantization"):
        check_activation_quant("int8", "none")
    check_activation_quant("int8", "gguf")
    with pytest.raises(ValueError, match="CPU only"):
        check_activation_quant("int8", "int8", torch.device("cuda"))
    with pytest.raises(ValueError, match="--activation-quant int8"):  # auto resolved to none
        ModelRunner(llama_dir, dtype="float32", num_slots=64, max_rows=2, max_context=64,
                    show_progress=False, quantization="auto", activation_quant="int8")
    with pytest.raises(ValueError, match="--activation-quant int8: this model has no"):
        enable_int8_activations(_dense(16, 64))


@pytest.mark.parametrize("symmetric", [False, True])
def test_a_panel_gives_the_same_bits_in_a_pair_as_alone(symmetric: bool) -> None:
    """Steps of 2+ tokens on AVX512-VNNI take panels two at a time (a last odd one alone): a
    panel's rows come out the same bits either way, whatever the token block."""
    codes, scale, low = _int4_given(48, 256, 32, False, 11)  # 3 panels: a pair, one alone
    if symmetric:  # Q4_0: the minimum a fixed -8 x scale, read by no kernel
        low = scale * -8
    x = _activations(13, 256, 5)

    def rows(lo: int, hi: int) -> torch.Tensor:
        layer = _dense(hi - lo, 256, bias=False)
        layer.convert(Int4Method(32, given=(codes[lo:hi], scale[lo:hi], low[lo:hi])))
        enable_int8_activations(layer)
        assert (layer.method.mins is None) == symmetric
        return layer(x)

    whole = rows(0, 48)
    for lo in (0, 16, 32):
        assert torch.equal(whole[:, lo:lo + 16], rows(lo, lo + 16))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_token_of_a_step_gets_the_bits_it_gets_alone(fmt: str) -> None:
    """A one-token step runs a half-panel loop of its own, longer ones other half-panel loops
    or (AVX512-VNNI) the panel loops, two panels at a time and a last odd one alone: the same
    integer sums and float steps, so a token's outputs do not depend on the step it is in (a
    speculative check or a batch gives a decode's bits)."""
    layer = FORMATS[fmt](48, 256)  # 3 panels: a pair, one alone
    enable_int8_activations(layer)
    x = _activations(13, 256, 7)
    whole = layer(x)
    for t in range(13):
        assert torch.equal(whole[t:t + 1], layer(x[t:t + 1]))
