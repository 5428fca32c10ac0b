"""Weight-only int8/int4 linears: the kernels against a float64 product of the dequantized
weights, the quantizers' error bounds, the engine's greedy output against transformers running
the same dequantized weights, and the startup errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from banyan import Engine, SamplingParams
from banyan.args import EngineArgs
from banyan.attention.decode_tiles import tiles_mode
from banyan.kernels import native
from banyan.layers.gemm_tiles import set_gemm_tiles
from banyan.layers.linear import Linear, SkinnyBf16Method
from banyan.layers.quant import Int4Method, Int8Method, check_quantization, dequantize_in_place
from banyan.runner.model_runner import ModelRunner

needs_kernels = pytest.mark.skipif(native.load() is None, reason="native kernels did not build")

# (out, in, tokens): rows not a multiple of the 16-row panel, every token-block size of the
# kernel (1..8 and a remainder past 8), inputs not a multiple of the unroll (int8).
INT8_SHAPES = [(1, 5, 1), (37, 67, 3), (200, 256, 13), (16, 96, 8), (45, 160, 64)]
INT4_SHAPES = [(1, 32, 1), (37, 64, 2), (50, 128, 7), (33, 256, 13), (16, 384, 5)]


def _check_against_float64(layer: Linear, tokens: int, dtype: torch.dtype) -> None:
    x = torch.randn(tokens, layer.in_features).to(dtype)
    want = x.double() @ layer.method.dequantized_weight(layer).double().T
    if layer.bias is not None:
        want += layer.bias.double()
    got = layer(x)
    assert got.dtype == dtype and got.shape == (tokens, layer.out_features)
    # float32 sums over `in` terms; bf16 output adds its rounding (2^-8 relative)
    rel = 1e-5 * layer.in_features ** 0.5 if dtype == torch.float32 else 2**-7
    tol = rel * want.abs().max().item() + 1e-5
    assert (got.double() - want).abs().max().item() <= tol


@needs_kernels
@pytest.mark.parametrize("out_f,in_f,tokens", INT8_SHAPES)
def test_int8_kernel_matches_float64_of_dequantized(out_f: int, in_f: int, tokens: int) -> None:
    torch.manual_seed(out_f * 1000 + in_f)
    weight, bias = torch.randn(out_f, in_f), torch.randn(out_f)
    layer = Linear.from_weight(weight.clone(), bias.clone() if out_f % 2 else None)
    layer.convert(Int8Method())
    deq = layer.method.dequantized_weight(layer)
    # symmetric per-row quantization: error at most half a step, the row's max exact
    step = weight.abs().amax(1, keepdim=True) / 127
    assert ((deq - weight).abs() <= step / 2 + 1e-6).all()
    assert layer.weight_bytes() == out_f * (in_f + 4)
    for dtype in (torch.float32, torch.bfloat16):
        _check_against_float64(layer, tokens, dtype)


@needs_kernels
@pytest.mark.parametrize("method", ["int8", "int4", "int8g", "int4-float32-scales"])
def test_long_steps_go_through_gemm_on_exactly_dequantized_slabs(
        method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """From DEQUANT_MIN_TOKENS tokens the weight is dequantized natively, slab by slab (small
    slabs here: several, the last one partial), and multiplied by torch's GEMM: the slabs hold
    exactly dequantized_weight's values, and the result matches float64."""
    from banyan.layers import quant
    from banyan.layers.gguf_linear import GroupInt8Method

    torch.manual_seed(5)
    out_f, in_f = 70, 96
    layer = Linear.from_weight(torch.randn(out_f, in_f), torch.randn(out_f))
    if method == "int8g":
        layer.convert(GroupInt8Method(torch.randint(-128, 128, (out_f, in_f), dtype=torch.int8),
                                      torch.rand(out_f, in_f // 32)))
    elif method == "int4-float32-scales":  # GGUF's Q4_K
        given = (torch.randint(0, 16, (out_f, in_f), dtype=torch.uint8),
                 torch.rand(out_f, in_f // 32) * 0.1, -torch.rand(out_f, in_f // 32))
        layer.convert(Int4Method(32, given=given))
        for tokens in (1, 9):  # the panel kernel too
            _check_against_float64(layer, tokens, torch.float32)
    else:
        layer.convert(Int8Method() if method == "int8" else Int4Method(32))
    panels = layer.codes.shape[0]
    slabs = torch.empty(panels * 16, in_f)
    layer.method._dequantize(layer, 0, panels, slabs)
    assert torch.equal(slabs[:out_f], layer.method.dequantized_weight(layer))
    monkeypatch.setattr(quant, "SLAB_BYTES", 2 * 16 * in_f * 4)  # two panels a slab
    _check_against_float64(layer, quant.DEQUANT_MIN_TOKENS + 3, torch.float32)


@needs_kernels
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("out_f,in_f,tokens", INT4_SHAPES)
def test_int4_kernel_matches_float64_of_dequantized(out_f: int, in_f: int, tokens: int,
                                                    group: int) -> None:
    if in_f % group:
        pytest.skip("int4 needs whole groups")
    torch.manual_seed(out_f * 1000 + in_f + group)
    weight = torch.randn(out_f, in_f)
    layer = Linear.from_weight(weight.clone(), torch.randn(out_f))
    layer.convert(Int4Method(group))
    deq = layer.method.dequantized_weight(layer)
    grouped = weight.view(out_f, -1, group)
    step = (grouped.amax(-1) - grouped.amin(-1)) / 15
    bound = step.repeat_interleave(group, 1) * 0.51 + 1e-3  # half a step (+ float16 scales)
    assert ((deq - weight).abs() <= bound).all()
    for dtype in (torch.float32, torch.bfloat16):
        _check_against_float64(layer, tokens, dtype)


@needs_kernels
@pytest.mark.parametrize("scales", [torch.float16, torch.float32])
def test_int4_long_steps_keep_each_tokens_bits(scales: torch.dtype) -> None:
    """Steps of 24 tokens and more widen each panel's codes to floats once (AVX2) instead of
    once per token block: each token's row the bits it has in a step of its own, and within
    float32 rounding of float64; float16 scales (int4, Q4_0/Q4_1) and float32 (Q4_K)."""
    from banyan.layers.quant import quantize_int4

    torch.manual_seed(11)
    weight = torch.randn(45, 160)
    codes, scale, low = quantize_int4(weight, 32)
    layer = Linear.from_weight(weight.clone(), torch.randn(45))
    layer.convert(Int4Method(32, given=(codes, scale.to(scales), low.to(scales))))
    deq = layer.method.dequantized_weight(layer).double()
    for tokens in (24, 27, 64):
        x = torch.randn(tokens, 160)
        got = torch.empty(tokens, 45)
        layer.method._kernel(layer, x, got)
        alone = torch.empty(1, 45)
        for t in range(tokens):
            layer.method._kernel(layer, x[t:t + 1].contiguous(), alone)
            assert torch.equal(alone[0], got[t]), (tokens, t)
        want = x.double() @ deq.T + layer.bias.double()
        assert ((got.double() - want).abs() <= 1e-5 * want.abs().max()).all()


def _quantized_layer(method: str, out_f: int, in_f: int, bias: bool) -> Linear:
    from banyan.layers.gguf_linear import GroupInt8Method

    layer = Linear.from_weight(torch.randn(out_f, in_f), torch.randn(out_f) if bias else None)
    if method.startswith("int8g"):  # GGUF's Q8_0 (groups of 32) and Q6_K (16)
        group = int(method.removeprefix("int8g"))
        layer.convert(GroupInt8Method(torch.randint(-128, 128, (out_f, in_f), dtype=torch.int8),
                                      torch.rand(out_f, in_f // group) * 0.01, group))
    elif method == "int4-float32-scales":  # GGUF's Q4_K
        given = (torch.randint(0, 16, (out_f, in_f), dtype=torch.uint8),
                 torch.rand(out_f, in_f // 32) * 0.1, -torch.rand(out_f, in_f // 32))
        layer.convert(Int4Method(32, given=given))
    elif method == "int8":
        layer.convert(Int8Method())
    else:
        layer.convert(Int4Method(int(method.removeprefix("int4g"))))
    return layer


def _gemm_weight(layer: Linear, method: str) -> torch.Tensor:
    """What the bf16 GEMM multiplies, float64: the weight's values rounded once to bf16, but for
    int8 with a scale per row the codes (exact in bf16) before each sum is scaled, so the
    values unrounded."""
    values = layer.method.dequantized_weight(layer).double()
    return values if method == "int8" else values.bfloat16().double()


@needs_kernels
@pytest.mark.parametrize("method", ["int8", "int4g32", "int4g128", "int8g32", "int8g16",
                                    "int4-float32-scales"])
@pytest.mark.parametrize("out_f,in_f,tokens,bias", [(70, 128, 9, True), (16, 256, 8, False),
                                                    (49, 128, 21, False), (100, 384, 64, True),
                                                    (300, 256, 23, True)])
def test_bf16_gemm_matches_float64_of_the_weights_it_multiplies(method: str, out_f: int,
                                                                in_f: int, tokens: int,
                                                                bias: bool) -> None:
    """A bf16 model's long steps: bf16 activations times the weights rounded once to bf16 (or
    int8 codes, _gemm_weight), float32 sums, one rounding of each output (plus the float32 bias
    first). Every panel-group
    and token-block tail: rows not a multiple of 16 or 48, tokens not a multiple of 8; 300 rows:
    several groups a thread, each filled while the one before it computes. On a CPU
    without AVX512-BF16 this checks the kernel's scalar twin."""
    from banyan.kernels.native import bf16_gemm_here
    from banyan.layers.quant import BF16_GEMM_MIN_TOKENS

    torch.manual_seed(out_f + in_f + tokens)
    layer = _quantized_layer(method, out_f, in_f, bias)
    x = torch.randn(tokens, in_f).bfloat16()
    want = x.double() @ _gemm_weight(layer, method).T + (layer.bias.double() if bias else 0.0)
    got = layer.method._bf16_gemm(layer, x)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, out_f)
    tol = 2**-8 * want.abs() + 1e-4 * want.abs().max()
    assert ((got.double() - want).abs() <= tol).all()
    if bf16_gemm_here() and tokens >= BF16_GEMM_MIN_TOKENS:  # what the layer runs for bf16
        assert torch.equal(layer(x), got)


@needs_kernels
def test_int8_long_steps_multiply_the_codes_and_scale_each_sum() -> None:
    """int8 with a scale per row: the bf16 GEMM multiplies the codes, exact in bf16, and scales
    each sum, as the short steps' float32 kernel does. Rounding code x scale to bf16 first (as
    it once did) turns scale 1.0625 x codes 127 and -126 (134.9375, -133.875) into 135 and -134,
    and a pair of ones into 1, not 1.0625."""
    from banyan.layers.quant import BF16_GEMM_MIN_TOKENS

    row = torch.zeros(32)
    row[0], row[1] = 127 * 1.0625, -126 * 1.0625
    layer = Linear.from_weight(row.repeat(20, 1))
    layer.convert(Int8Method())
    assert torch.equal(layer.scale[:20], torch.full((20,), 1.0625))
    x = torch.zeros(BF16_GEMM_MIN_TOKENS, 32, dtype=torch.bfloat16)
    x[:, :2] = 1
    with torch.inference_mode():
        long = layer.method._bf16_gemm(layer, x)
        short = layer(x[:1])
    assert torch.equal(long, torch.full_like(long, 1.0625))
    assert torch.equal(short[0], long[0])


@needs_kernels
@pytest.mark.parametrize("method", ["int8", "int4g32", "int8g32", "int8g16",
                                    "int4-float32-scales"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_step_short_of_the_gemm_gives_each_token_its_bits_alone(method: str,
                                                                  dtype: torch.dtype) -> None:
    """Steps shorter than BF16_GEMM_MIN_TOKENS (a speculative check of up to 16 tokens, a batch
    of up to 16 decodes) take the short kernels, whose tokens come out as each would alone:
    speculation and batching change no output there. float32 activations show the kernels'
    float32 sums unrounded: their count of partial sums once depended on the token block (a
    GGUF model's Q8_0 head gave a check other logits than its decodes; bf16 outputs hid most
    of it)."""
    from banyan.layers.quant import BF16_GEMM_MIN_TOKENS, DEQUANT_MIN_TOKENS

    assert 16 < BF16_GEMM_MIN_TOKENS <= DEQUANT_MIN_TOKENS
    torch.manual_seed(3)
    layer = _quantized_layer(method, 70, 256, True)
    x = torch.randn(16, 256).to(dtype)
    with torch.inference_mode():
        whole = layer(x)
        for t in range(16):
            assert torch.equal(whole[t:t + 1], layer(x[t:t + 1]))


@needs_kernels
@pytest.mark.parametrize("method,out_f,in_f", [
    ("int8", 70, 100), ("int4g32", 70, 128), ("int8g32", 16, 608), ("int4-float32-scales", 33, 96)])
def test_long_bf16_steps_multiply_the_same_bf16_weight_by_onednn(
        method: str, out_f: int, in_f: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """From ONEDNN_MIN_TOKENS tokens a layer without bias dequantizes its weight into plain bf16
    rows (the rows of a last partial panel, inputs not a multiple of 32) for torch's GEMM: the
    very product torch computes on the dequantized weight rounded to bf16."""
    from banyan.kernels.native import bf16_gemm_here
    from banyan.layers import quant

    if not bf16_gemm_here():
        pytest.skip("the bf16 kernels need AVX512-BF16")
    monkeypatch.setattr(quant, "ONEDNN_MIN_TOKENS", 40)
    torch.manual_seed(out_f + in_f)
    layer = _quantized_layer(method, out_f, in_f, False)
    x = torch.randn(40, in_f).bfloat16()
    weight = layer.method.dequantized_weight(layer).bfloat16()
    assert torch.equal(layer(x), torch.mm(x, weight.t()))


@needs_kernels
@pytest.mark.parametrize("out_f,in_f,tokens", [(70, 128, 9), (49, 96, 21), (100, 608, 64),
                                               (16, 34, 12)])
def test_bf16_gemm_on_a_plain_bf16_weight(out_f: int, in_f: int, tokens: int) -> None:
    """The bf16 GEMM on a plain weight (its pairs transposed per call: inputs not a multiple of
    32 take the tail loop, rows not a multiple of 16 repeat the last row) and on the weight
    stored in its pairs (what a dense bf16 layer without a bias runs for steps of 1..GEMM_ROWS
    tokens): float32 sums and one rounding of each output, the same bits, and each token's the
    same as alone (9, 12 and 21 tokens: token blocks of unequal sizes)."""
    torch.manual_seed(out_f + in_f + tokens)
    weight = torch.randn(out_f, in_f).bfloat16()
    x = torch.randn(tokens, in_f).bfloat16()
    want = x.double() @ weight.double().T
    with tiles_mode(0, set_gemm_tiles):  # the vector loop (AMX's tiles sum long steps apart)
        _check_bf16_gemm(weight, x, want)


def _check_bf16_gemm(weight: torch.Tensor, x: torch.Tensor, want: torch.Tensor) -> None:
    from banyan.kernels.native import bf16_gemm, bf16_pairs_gemm
    from banyan.layers.panels import pack_bf16_pairs

    (tokens, in_f), out_f = x.shape, weight.shape[0]
    got = bf16_gemm(x, weight)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, out_f)
    tol = 2**-8 * want.abs() + 1e-4 * want.abs().max()
    assert ((got.double() - want).abs() <= tol).all()
    pairs = pack_bf16_pairs(weight)
    assert pairs.shape == (-(-out_f // 16), in_f // 2, 16) and pairs.data_ptr() % 64 == 0
    assert torch.equal(bf16_pairs_gemm(x, pairs, out_f), got)  # the stored pairs: same bits
    for t in range(tokens):  # a token's bits whatever block of the step it falls in
        assert torch.equal(bf16_pairs_gemm(x[t : t + 1], pairs, out_f), got[t : t + 1])
    layer = Linear.from_weight(weight.clone())
    if SkinnyBf16Method.available(torch.device("cpu"), torch.bfloat16) and \
            SkinnyBf16Method.takes_gemm(layer):
        layer.convert(SkinnyBf16Method())
        assert torch.equal(layer(x), got)  # what a dense bf16 layer runs for these steps
        assert torch.equal(layer(x[:1]), got[:1])  # and for one token


@needs_kernels
@pytest.mark.parametrize("method", ["int4g32", "int4g64", "int4g128", "int4-float32-scales",
                                    "int8g32", "int8g16", "int8"])
@pytest.mark.parametrize("out_f,in_f,bias", [(70, 128, True), (16, 256, False), (33, 384, True),
                                             (20, 100, True), (20, 102, False)])
def test_quantized_short_bf16_steps(method: str, out_f: int, in_f: int, bias: bool) -> None:
    """A bf16 model's steps of 1-8 tokens on int4 codes (cpu_int4_bf16_linear.cpp) or int8
    codes with a scale per row (inputs a multiple of 4, as 100) or per group (GGUF's Q8_0, Q6_K;
    codes of -128 too) (cpu_int8_bf16_linear.cpp; 102 inputs: its entry declines): each
    output within one bf16
    rounding of float64 (the bias added first), a token's row the same bits in a step of any
    size (a speculative check gives what a decode would), and where no bf16 kernel serves, the
    float32 kernel's bits rounded."""
    if in_f % 32 and method != "int8":
        pytest.skip("groups of 32 (or 16) inputs")
    torch.manual_seed(out_f + in_f)
    layer = _quantized_layer(method, out_f, in_f, bias)
    x = torch.randn(8, in_f).bfloat16()
    want = x.double() @ layer.method.dequantized_weight(layer).double().T
    if bias:
        want += layer.bias.double()
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (8, out_f)
    # half a bf16 ulp is at most 2^-8 of the value; float32 sums add a little
    assert ((got.double() - want).abs() <= 2**-8 * want.abs() + 1e-5 * want.abs().max()).all()
    for size in (1, 3, 5):
        assert torch.equal(torch.cat([layer(x[i : i + size]) for i in range(0, 8, size)]), got)
    if not native.codes_bf16_here() or in_f % 4:  # the float32 kernel's
        flat = torch.empty(8, out_f)
        layer.method._kernel(layer, x.float(), flat)
        assert torch.equal(flat.bfloat16(), got)


@needs_kernels
def test_odd_widths_in_bf16_take_the_float32_kernels() -> None:
    """The bf16 GEMM reads inputs in pairs: a layer of odd width (int8 has no groups) runs its
    long bf16 steps through the float32 kernels instead, still correct."""
    torch.manual_seed(3)
    layer = Linear.from_weight(torch.randn(37, 67), torch.randn(37))
    layer.convert(Int8Method())
    _check_against_float64(layer, 21, torch.bfloat16)


def test_int4_group_and_shape_errors() -> None:
    with pytest.raises(ValueError, match="int4 group must be one of"):
        Int4Method(48)
    layer = Linear.from_weight(torch.randn(4, 40))
    with pytest.raises(ValueError, match="divisible"):
        layer.convert(Int4Method(32))


def test_startup_errors_name_the_format() -> None:
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineArgs(quantization="fp4")
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match="blocks on CPU only"):
        check_quantization("gguf", cuda, torch.float32, [64])
    check_quantization("int8", cuda, torch.float16, [64])  # the Triton kernel's (quant_cuda)
    with pytest.raises(ValueError, match=r"linear layers with \[40\] inputs"):
        check_quantization("int4", cuda, torch.bfloat16, [64, 40])
    with pytest.raises(ValueError, match="runs on CPU and CUDA"):
        check_quantization("int8", torch.device("mps"), torch.float32, [64])
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        check_quantization("int8", cpu, torch.float16, [64])
    with pytest.raises(ValueError, match=r"linear layers with \[40\] inputs"):
        check_quantization("int4", cpu, torch.float32, [64, 40])


def test_startup_error_without_kernels(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "load", lambda: None)
    with pytest.raises(ValueError, match="needs the native CPU kernels"):
        ModelRunner(llama_dir, dtype="float32", num_slots=64, max_rows=2, max_context=64,
                    show_progress=False, quantization="int8")


def _hf_with_weights_of(runner: ModelRunner, path: Path) -> torch.nn.Module:
    """transformers' model of `path` with every linear replaced by the runner's dequantized
    weights (split back into q/k/v and gate/up; the tied head untied)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    model = runner.model
    dequantize_in_place(model)
    ours = dict(model.named_parameters())
    hf_params = dict(hf.named_parameters())
    with torch.no_grad():
        for hf_name, slot in model.checkpoint_layout().items():
            if hf_name in hf_params and slot.param in ours:
                source = ours[slot.param]
                if slot.rows is not None:
                    source = source.narrow(0, slot.start, slot.rows)
                hf_params[hf_name].copy_(source)
        head = model.lm_head if model.lm_head is not None else model.tied_head
        hf.lm_head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
    return hf


def _hf_greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def assert_greedy_equals_torch(path: Path, quantization: str, requests: int, steps: int,
                               method_prefix: str) -> None:
    """A float32 engine with `--quantization` on CPU: every linear's method named
    method_prefix..., and each request's greedy tokens transformers' with the weights those
    methods multiply by."""
    prompts = [[5 + (7 * i + 3 * j) % 400 for j in range(9 + 5 * i)] for i in range(requests)]
    params = SamplingParams(max_new_tokens=steps, temperature=0.0, ignore_eos=True)
    with Engine(str(path), dtype="float32", device="cpu", disable_tqdm=True,
                quantization=quantization) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=[params] * len(prompts))
        runner = engine.core.scheduler.runner.model_runner
        linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
        assert linears and all(type(m.method).__name__.lower().startswith(method_prefix)
                               for m in linears)
        hf = _hf_with_weights_of(runner, path)
    for prompt, out in zip(prompts, outs):
        assert out.output_ids == _hf_greedy(hf, prompt, steps)


@needs_kernels
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_engine_greedy_equals_torch_with_the_dequantized_weights(
        model_dirs: dict[str, Path], quantization: str) -> None:
    # qwen2: a tied head and q/k/v biases (the quantized head is a copy)
    assert_greedy_equals_torch(model_dirs["qwen2"], quantization, 3, 12, quantization)
