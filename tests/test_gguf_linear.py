"""`--quantization gguf`: linear layers computed from a GGUF file's own Q8_0 / Q4_0 / Q4_1 /
Q5_0 / Q4_K / Q6_K blocks. Every repacked layer holds exactly the values transformers dequantizes
from the file (bit for bit), the grouped int8 kernel matches float64 over them (odd shapes, every
token-block size), other types stay dense, the engine's greedy output equals transformers' on the
dequantized model, and a non-GGUF model is refused at startup."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from banyan.kernels import native
from banyan.layers.gguf_linear import GroupInt8Method
from banyan.layers.linear import Linear, model_weight_bytes
from banyan.layers.quant import Int4Method, _QuantMethod
from banyan.model_files import resolve_model_dir
from banyan.runner.model_runner import ModelRunner

gguf = pytest.importorskip("gguf")
from tests.gguf_helpers import write_gguf  # noqa: E402  (needs gguf)

pytestmark = pytest.mark.skipif(native.load() is None, reason="native CPU kernels unavailable")


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BANYAN_CACHE_DIR", str(tmp_path / "cache"))


def _runner(gguf_file: Path, quantization: str) -> ModelRunner:
    return ModelRunner(resolve_model_dir(str(gguf_file), show_progress=False), dtype="float32",
                       num_slots=64, max_rows=2, show_progress=False, quantization=quantization,
                       gguf_file=gguf_file if quantization == "gguf" else None)


def _linears(runner: ModelRunner) -> dict[str, Linear]:
    return {n: m for n, m in runner.model.named_modules() if isinstance(m, Linear)}


MIXES = {"Q5_0": {"attn_v": "Q8_0"}, "Q4_1": {"attn_k": "Q4_K", "ffn_up": "Q4_0"}}


@pytest.mark.parametrize("wtype,arch,tied,mixed", [
    ("Q8_0", "llama", True, False), ("Q4_0", "qwen2", False, False),
    ("Q4_1", "llama", False, False), ("Q4_K", "llama", True, False),
    ("Q6_K", "qwen2", False, False), ("Q5_0", "llama", True, False),
    ("Q5_0", "llama", True, True), ("Q4_1", "qwen2", False, True)])
def test_repacked_layers_hold_the_files_values(tmp_path: Path, tokenizer_dir: Path, wtype: str,
                                               arch: str, tied: bool, mixed: bool) -> None:
    """llama's q/k rows are permuted back and qwen2 keeps its biases; a tied head takes the
    embedding's blocks; a fused projection may mix types that decode alike (MIXES, as
    llama.cpp's Q4_K_M keeps v in Q8_0 beside Q5_0 q and k). Dequantized, every layer equals
    the dense load of the same file."""
    path = write_gguf(tmp_path / "m.gguf", tokenizer_dir, arch, wtype, tied=tied,
                      types=MIXES[wtype] if mixed else None)
    dense, packed = _runner(path, "none"), _runner(path, "gguf")
    method = GroupInt8Method if wtype in ("Q8_0", "Q6_K", "Q5_0") else Int4Method
    layers = _linears(packed)
    assert ("tied_head" in layers) == tied
    for name, layer in layers.items():
        assert type(layer.method) is method, name
        want = (dense.model.embed_tokens.weight if name == "tied_head"
                else _linears(dense)[name].weight)
        assert torch.equal(layer.method.dequantized_weight(layer), want), name
        x = torch.randn(3, layer.in_features)
        ref = x.double() @ want.double().T
        if layer.bias is not None:
            ref += layer.bias.double()
        torch.testing.assert_close(layer(x).double(), ref, atol=1e-4, rtol=1e-4)
    assert packed.model.embed_tokens.weight.dtype == torch.float32  # lookups stay dense


@pytest.mark.parametrize("rows,cols,tokens", [(16, 32, 1), (37, 96, 3), (50, 64, 9), (5, 160, 8)])
def test_grouped_int8_kernel_matches_float64(rows: int, cols: int, tokens: int) -> None:
    gen = torch.Generator().manual_seed(rows * cols + tokens)
    codes = torch.randint(-128, 128, (rows, cols), generator=gen, dtype=torch.int8)
    scale = torch.rand(rows, cols // 32, generator=gen) * 0.02
    bias = torch.randn(rows, generator=gen)
    layer = Linear.from_weight(torch.zeros(rows, cols), bias)
    layer.convert(GroupInt8Method(codes, scale))
    want_w = codes.double() * scale.double().repeat_interleave(32, dim=1)
    x = torch.randn(tokens, cols, generator=gen)
    want = x.double() @ want_w.T + bias.double()
    torch.testing.assert_close(layer(x).double(), want, atol=1e-4, rtol=1e-5)
    assert layer.weight_bytes() == rows * (cols + 4 * (cols // 32))


def test_other_types_stay_dense(tmp_path: Path, tokenizer_dir: Path,
                                caplog: pytest.LogCaptureFixture) -> None:
    path = write_gguf(tmp_path / "k.gguf", tokenizer_dir, wtype="Q5_K", embed_type="Q8_0",
                      tied=True)
    with caplog.at_level(logging.INFO):
        packed = _runner(path, "gguf")
    layers = _linears(packed)
    assert isinstance(layers["tied_head"].method, GroupInt8Method)  # the Q8_0 embedding
    others = [n for n, m in layers.items() if n != "tied_head"]
    assert others and not any(isinstance(layers[n].method, _QuantMethod) for n in others)
    assert "keep dense weights" in caplog.text and "Q5_K" in caplog.text
    # the loader skips only the linears the blocks replace: these were read
    dense = _linears(_runner(path, "none"))
    assert all(torch.equal(layers[n].weight, dense[n].weight) for n in others)


@pytest.mark.parametrize("wtype", ["Q8_0", "Q4_1", "Q4_K"])
def test_greedy_equals_transformers_on_the_dequantized_model(tmp_path: Path,
                                                             tokenizer_dir: Path,
                                                             wtype: str) -> None:
    from banyan import Engine, SamplingParams
    from tests.hf_reference import hf_greedy

    path = write_gguf(tmp_path / "m.gguf", tokenizer_dir, wtype=wtype, tied=True, seed=3)
    prompts = [[5 + i for i in range(n)] for n in (4, 30, 90)]
    folder = resolve_model_dir(str(path), show_progress=False)
    expected = [hf_greedy(folder, p, 8) for p in prompts]
    with Engine(str(path), dtype="float32", quantization="gguf", disable_tqdm=True,
                kv_cache_memory="4MiB") as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=SamplingParams(
            max_new_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
        read = engine.core.weight_bytes  # a step reads the blocks (1.06-1.13 bytes a weight)
    assert read < model_weight_bytes(_runner(path, "none").model) / 3  # not float32's 4
    assert [o.outputs[0].output_ids for o in outs] == expected


def test_a_model_that_is_not_gguf_is_refused(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="--quantization gguf .* GGUF file"):
        ModelRunner(llama_dir, dtype="float32", num_slots=16, max_rows=1, show_progress=False,
                    quantization="gguf")


def test_auto_is_gguf_for_a_gguf_model_and_none_otherwise(tmp_path: Path, tokenizer_dir: Path,
                                                          llama_dir: Path) -> None:
    from banyan import Engine

    path = write_gguf(tmp_path / "m.gguf", tokenizer_dir, wtype="Q4_0")
    for model, want in ((path, "gguf"), (llama_dir, "none")):
        with Engine(str(model), dtype="float32", disable_tqdm=True,
                    kv_cache_memory="4MiB") as engine:  # --quantization left at auto
            assert engine.core.scheduler.runner.model_runner.quantization == want
