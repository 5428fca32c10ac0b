"""The weight-only int8 / int4 linear of the CUDA path (kernels/triton_quant_linear.py, the
methods of layers/quant_cuda.py) against float64 products of the values it multiplies by.

Without a GPU the kernel runs under Triton's interpreter (tests/triton_device.py), where bf16
products run in float32 (numpy has no bfloat16): the tolerance is then float32's for the
products, the weights and activations being the bf16 values either way. Shapes cover row
blocks of 16 and 64 with partial ones (1, 5, 17, 70 rows), output widths that are not multiples
of the 64-wide block, inputs that are not multiples of the 64-deep one, every int4 group size,
with and without bias. On a CUDA machine the same tests run the compiled kernel.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.triton_device import DEVICE, skip_if_compiled_without_gpu

pytest.importorskip("triton")

from banyan import Engine, SamplingParams  # noqa: E402
from banyan.kernels import triton_quant_linear  # noqa: E402
from banyan.layers.linear import Linear  # noqa: E402
from banyan.layers.quant import Int4Method, Int8Method, quantized_method  # noqa: E402
from banyan.layers.quant_cuda import TritonInt4Method, TritonInt8Method  # noqa: E402

skip_if_compiled_without_gpu()

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _layer(out_f: int, in_f: int, bias: bool, dtype: torch.dtype, seed: int) -> Linear:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_f, in_f, generator=g) * (0.5 + torch.rand(out_f, 1, generator=g))
    b = torch.randn(out_f, generator=g) if bias else None
    return Linear.from_weight(weight.to(dtype).to(DEVICE), None if b is None else
                              b.to(dtype).to(DEVICE))


def _check(layer: Linear, rows: int, dtype: torch.dtype, seed: int = 1) -> None:
    """Each output within the tolerance of float64's product of x (as the kernel reads it) and
    the method's dequantized weight (+ bias), relative to the output's magnitude."""
    x = torch.randn(rows, layer.in_features, generator=torch.Generator().manual_seed(seed))
    x = x.to(dtype).to(DEVICE)
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, layer.out_features)
    weight = layer.method.dequantized_weight(layer).double()
    if dtype != torch.float32:  # the product's operands: weights rounded to x's dtype
        weight = weight.to(dtype).double()
    want = x.double() @ weight.t()
    if layer.bias is not None:
        want += layer.bias.double()
    scale = want.abs().max().item() + 1.0
    out_tol = TOL[dtype] if dtype != torch.float32 else TOL[torch.float32]
    assert (got.double() - want).abs().max().item() <= out_tol * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 17, 70])
@pytest.mark.parametrize("out_f,in_f,bias", [(37, 96, True), (130, 200, False)])
def test_int8_against_float64(dtype: torch.dtype, rows: int, out_f: int, in_f: int,
                              bias: bool) -> None:
    layer = _layer(out_f, in_f, bias, dtype, seed=rows)
    layer.convert(TritonInt8Method())
    assert layer.codes.dtype == torch.int8 and layer.codes.shape == (out_f, in_f)
    _check(layer, rows, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 17, 70])
@pytest.mark.parametrize("group,in_f", [(32, 96), (64, 192), (128, 256)])
def test_int4_against_float64(dtype: torch.dtype, rows: int, group: int, in_f: int) -> None:
    layer = _layer(83, in_f, rows != 17, dtype, seed=group + rows)
    layer.convert(TritonInt4Method(group))
    assert layer.codes.shape == (83, in_f // 2) and layer.scale.shape == (83, in_f // group)
    _check(layer, rows, dtype)


@pytest.mark.parametrize("cpu_method,cuda_method", [(Int8Method, TritonInt8Method),
                                                    (Int4Method, TritonInt4Method)])
def test_the_same_values_as_the_cpu_methods(cpu_method: type, cuda_method: type) -> None:
    """Both devices' methods quantize a weight to the same values (one format, two layouts)."""
    weight = torch.randn(45, 128, generator=torch.Generator().manual_seed(3))
    cpu, cuda = Linear.from_weight(weight.clone()), Linear.from_weight(weight.clone().to(DEVICE))
    cpu.convert(cpu_method())
    cuda.convert(cuda_method())
    assert torch.equal(cpu.method.dequantized_weight(cpu),
                       cuda.method.dequantized_weight(cuda).cpu())


def test_bytes_and_errors() -> None:
    layer = _layer(64, 96, False, torch.float32, seed=0)
    layer.convert(TritonInt4Method(32))
    assert layer.weight_bytes() == 64 * (48 + 4 * 3)
    with pytest.raises(ValueError, match="int4 group must be one of"):
        TritonInt4Method(48)
    with pytest.raises(ValueError, match="divisible"):
        _layer(4, 40, False, torch.float32, seed=0).convert(TritonInt4Method(32))
    with pytest.raises(ValueError, match="do not fit"):
        triton_quant_linear.quant_linear(torch.zeros(2, 64, device=DEVICE), layer.codes,
                                         layer.scale, layer.mins, 32)
    assert quantized_method("int4", torch.device("cuda")) is TritonInt4Method
    assert quantized_method("int8", torch.device("cpu")) is Int8Method


@pytest.mark.cuda
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_engine_on_cuda_runs_the_kernel(llama_dir: Path, quantization: str) -> None:
    """On a GPU, `--quantization` quantizes every linear to the Triton methods, and greedy
    decoding runs (the CPU tests compare the quantized text with torch's)."""
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    with Engine(str(llama_dir), dtype="bfloat16", device="cuda", disable_tqdm=True,
                quantization=quantization) as engine:
        out = engine.generate(input_ids=[[5, 6, 7, 8]], sampling_params=params)[0]
        model = engine.core.scheduler.runner.model_runner.model
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        assert linears and all(type(m.method).__name__.startswith("Triton") for m in linears)
    assert len(out.output_ids) == 6


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_engine_greedy_equals_torch_with_the_dequantized_weights(
        model_dirs: dict[str, Path], quantization: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole model on the CUDA methods (here through the interpreter, their choice forced
    on CPU): a tied head quantized as a copy, q/k/v biases, prefill and decode steps; greedy
    tokens equal to transformers' with the weights the methods multiply by."""
    if DEVICE == "cuda":
        pytest.skip("test_engine_on_cuda_runs_the_kernel runs the engine on the GPU")
    from banyan.runner import linear_setup
    from tests.test_quant import assert_greedy_equals_torch

    monkeypatch.setattr(linear_setup, "quantized_method",
                        lambda q, device: quantized_method(q, torch.device("cuda")))
    assert_greedy_equals_torch(model_dirs["qwen2"], quantization, 2, 6, "triton")
