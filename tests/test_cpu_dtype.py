"""`--dtype auto` on a CPU: a bfloat16/float16 checkpoint computes in float32 where the CPU has
no units for the half type (banyan/runner/cpu_dtype.py), and in its own type where it has."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from banyan import Engine, SamplingParams
from banyan.demo import build_random_model
from banyan.runner.cpu_dtype import auto_cpu_dtype, compute_dtype, cpu_computes

ZEN3 = "flags : fpu sse sse2 avx f16c fma avx2 bmi2"  # no half-type arithmetic
ZEN4 = ZEN3 + " avx512f avx512bw avx512_vnni avx512_bf16"
SAPPHIRE_RAPIDS = ZEN4 + " avx512_fp16 amx_bf16 amx_tile amx_int8"
GIB = 2**30


@pytest.mark.parametrize("flags,checkpoint,want", [
    (ZEN3, torch.bfloat16, torch.float32),
    (ZEN3, torch.float16, torch.float32),
    (ZEN3, torch.float32, torch.float32),
    (ZEN4, torch.bfloat16, torch.bfloat16),
    (ZEN4, torch.float16, torch.float32),  # bf16 units do not compute float16
    (SAPPHIRE_RAPIDS, torch.float16, torch.float16),
    (ZEN3.replace("avx2", "") + " amx_bf16", torch.bfloat16, torch.bfloat16),
    ("", torch.bfloat16, torch.bfloat16),  # flags unknown (no /proc/cpuinfo): as the file says
])
def test_auto_keeps_half_types_only_where_the_cpu_computes_them(
        flags: str, checkpoint: torch.dtype, want: torch.dtype) -> None:
    dtype, why = auto_cpu_dtype(checkpoint, GIB, 16 * GIB, flags)
    assert dtype == want
    assert (why is None) == (dtype == checkpoint)
    if why:  # the message names the missing units and the way back
        half = "BF16" if checkpoint == torch.bfloat16 else "FP16"
        assert half in why and f"--dtype {str(checkpoint)[6:]}" in why


def test_auto_keeps_the_half_type_when_float32_weights_would_crowd_memory() -> None:
    # 3 GiB of bfloat16 -> 6 GiB of float32: too much for 10 GiB free, fine for 12
    assert auto_cpu_dtype(torch.bfloat16, 3 * GIB, 10 * GIB, ZEN3)[0] == torch.bfloat16
    assert auto_cpu_dtype(torch.bfloat16, 3 * GIB, 12 * GIB, ZEN3)[0] == torch.float32


def test_only_auto_on_a_cpu_is_widened(tmp_path: Path) -> None:
    expect = torch.float32 if cpu_computes(torch.bfloat16) is False else torch.bfloat16
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert compute_dtype("auto", torch.bfloat16, cpu, tmp_path) == expect
    assert compute_dtype(None, torch.bfloat16, cpu, tmp_path) == expect
    assert compute_dtype("bfloat16", torch.bfloat16, cpu, tmp_path) == torch.bfloat16
    assert compute_dtype("auto", torch.bfloat16, cuda, tmp_path) == torch.bfloat16
    assert compute_dtype("float16", torch.bfloat16, cpu, tmp_path) == torch.float16


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama-bf16")
    return build_random_model(out, "llama", tokenizer_dir=tokenizer_dir, dtype="bfloat16",
                              hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2,
                              initializer_range=0.1)  # (logits far from ties)


def test_a_bf16_checkpoint_on_this_cpu(bf16_llama: Path, caplog: pytest.LogCaptureFixture
                                       ) -> None:
    """auto on this machine's CPU: float32 without bf16 units (the same tokens as an explicit
    float32 engine, and a warning saying why), bfloat16 with them; the engine reports which."""
    widened = cpu_computes(torch.bfloat16) is False
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 17, 33, 2, 90], [7, 7, 300]]
    kw = dict(device="cpu", disable_tqdm=True, kv_cache_memory="4MiB")
    with caplog.at_level(logging.WARNING, logger="banyan.runner.cpu_dtype"):
        with Engine(str(bf16_llama), dtype="auto", **kw) as engine:
            assert engine.core.dtype == ("float32" if widened else "bfloat16")
            auto = [o.outputs[0].output_ids for o in engine.generate(
                input_ids=prompts, sampling_params=params)]
    assert any("no AVX512_BF16" in r.getMessage() for r in caplog.records) == widened
    want = "float32" if widened else "bfloat16"
    with Engine(str(bf16_llama), dtype=want, **kw) as engine:
        assert engine.core.dtype == want
        assert auto == [o.outputs[0].output_ids for o in engine.generate(
            input_ids=prompts, sampling_params=params)]


def test_quantized_linears_compute_in_bf16_where_the_cpu_does(tmp_path: Path) -> None:
    """auto with quantized linears: bfloat16 where the bf16 GEMM over quantized weights runs on
    this CPU's bf16 units, else the checkpoint's float32; an explicit dtype always wins."""
    from banyan.kernels.native import bf16_gemm_here

    cpu = torch.device("cpu")
    expect = torch.bfloat16 if bf16_gemm_here() else torch.float32
    assert compute_dtype("auto", torch.float32, cpu, tmp_path, quantized=True) == expect
    assert compute_dtype("auto", torch.float32, cpu, tmp_path) == torch.float32
    assert compute_dtype("float32", torch.float32, cpu, tmp_path, quantized=True) == torch.float32
    assert compute_dtype("auto", torch.float32, torch.device("cuda"), tmp_path,
                         quantized=True) == torch.float32


def test_a_quantized_model_at_auto_on_this_cpu(llama_dir: Path) -> None:
    """int8 linears at auto: the engine's dtype follows the rule above (and runs)."""
    from banyan.kernels.native import bf16_gemm_here

    with Engine(str(llama_dir), quantization="int8", device="cpu", disable_tqdm=True,
                kv_cache_memory="4MiB") as engine:
        assert engine.core.dtype == ("bfloat16" if bf16_gemm_here() else "float32")
        out = engine.generate(input_ids=[[5, 17, 33]], sampling_params=SamplingParams(
            max_new_tokens=4, temperature=0.0, ignore_eos=True))
        assert len(out[0].outputs[0].output_ids) == 4
