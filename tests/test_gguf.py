"""GGUF loading on small files written here with gguf's GGUFWriter: every supported tensor type,
the architectures with their quirks (llama's permuted q/k rows, qwen2's biases, qwen3's q/k
norms), each compared weight for weight with transformers loading the same file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from banyan.demo import CHATML_TEMPLATE
from banyan.model_files import load_tokenizer, resolve_model_dir
from banyan.models.gguf_dequant import QUANTIZED_TYPES, SUPPORTED_TYPES, check_supported
from banyan.models.gguf_loader import find_gguf, open_gguf
from banyan.models.loader import load_model

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

HIDDEN, INTER, LAYERS = 256, 512, 2  # K-quants need rows of 256
# (heads, kv heads): head_dim 64, except qwen3, where transformers ignores the file's key_length
# and keeps its default head_dim of 128 (Banyan reads key_length; the oracle must agree).
HEADS = {"llama": (4, 2), "qwen2": (4, 2), "qwen3": (2, 1)}
# f16 fields (scales d, dmin, m) inside one block of the types gguf cannot quantize in Python:
# random bytes elsewhere are valid quants; the scales are set to small finite numbers.
_K_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BANYAN_CACHE_DIR", str(tmp_path / "cache"))


def _encode(x: np.ndarray, type_name: str, rng: np.random.Generator) -> np.ndarray:
    qtype = Q[type_name]
    if type_name == "F32":
        return x
    if type_name == "F16":
        return x.astype(np.float16)
    if type_name not in _K_SCALES:
        return gguf.quants.quantize(x, qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (x.shape[0], x.shape[1] // block * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    for off in _K_SCALES[type_name]:
        scales = rng.uniform(0.001, 0.02, blocks.shape[0]).astype(np.float16)
        blocks[:, off:off + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw


def write_gguf(path: Path, tokenizer_dir: Path, arch: str = "llama", wtype: str = "Q8_0",
               seed: int = 0) -> Path:
    """A 2-layer `arch` model whose matrices are all of ggml type `wtype`, with the tests'
    BPE tokenizer and a ChatML template in its metadata."""
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    heads, kv_heads = HEADS[arch]
    head_dim = HIDDEN // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)
    rng = np.random.default_rng(seed)

    def matrix(name: str, rows: int, cols: int) -> None:
        x = rng.normal(0, 0.1, (rows, cols)).astype(np.float32)
        data = _encode(x, wtype, rng)
        if wtype in ("F32", "F16"):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=Q[wtype])

    def vector(name: str, n: int, mean: float = 0.0) -> None:
        w.add_tensor(name, (mean + rng.normal(0, 0.1, n)).astype(np.float32))

    matrix("token_embd.weight", len(tokens), HIDDEN)
    vector("output_norm.weight", HIDDEN, 1.0)
    matrix("output.weight", len(tokens), HIDDEN)
    for i in range(LAYERS):
        vector(f"blk.{i}.attn_norm.weight", HIDDEN, 1.0)
        vector(f"blk.{i}.ffn_norm.weight", HIDDEN, 1.0)
        matrix(f"blk.{i}.attn_q.weight", heads * head_dim, HIDDEN)
        matrix(f"blk.{i}.attn_k.weight", kv_heads * head_dim, HIDDEN)
        matrix(f"blk.{i}.attn_v.weight", kv_heads * head_dim, HIDDEN)
        matrix(f"blk.{i}.attn_output.weight", HIDDEN, heads * head_dim)
        matrix(f"blk.{i}.ffn_gate.weight", INTER, HIDDEN)
        matrix(f"blk.{i}.ffn_up.weight", INTER, HIDDEN)
        matrix(f"blk.{i}.ffn_down.weight", HIDDEN, INTER)
        if arch == "qwen2":
            for part, n in (("attn_q", heads), ("attn_k", kv_heads), ("attn_v", kv_heads)):
                vector(f"blk.{i}.{part}.bias", n * head_dim)
        if arch == "qwen3":
            vector(f"blk.{i}.attn_q_norm.weight", head_dim, 1.0)
            vector(f"blk.{i}.attn_k_norm.weight", head_dim, 1.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_state(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32)
    return model.state_dict()


def assert_same_weights(gguf_file: Path, dtype: torch.dtype = torch.float32) -> None:
    """Banyan's loaded parameters equal transformers' dequantized GGUF tensors exactly."""
    model = load_model(resolve_model_dir(str(gguf_file), show_progress=False), dtype=dtype,
                       show_progress=False)
    params = dict(model.named_parameters())
    ref = hf_state(gguf_file)
    for name, slot in model.checkpoint_layout().items():
        ours = params[slot.param]
        if slot.rows is not None:
            ours = ours.narrow(0, slot.start, slot.rows)
        expected = ref[name].to(dtype)
        assert torch.equal(ours, expected), (name, (ours.float() - expected.float()).abs().max())


@pytest.mark.parametrize("wtype", ["F32", "F16", "BF16", *QUANTIZED_TYPES])
def test_every_tensor_type_matches_transformers(tmp_path: Path, tokenizer_dir: Path,
                                                wtype: str) -> None:
    assert_same_weights(write_gguf(tmp_path / f"tiny-{wtype}.gguf", tokenizer_dir, wtype=wtype))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_architectures_match_transformers(tmp_path: Path, tokenizer_dir: Path, arch: str) -> None:
    assert_same_weights(write_gguf(tmp_path / f"{arch}.gguf", tokenizer_dir, arch, "Q4_K"))


def test_dtype_cast_after_dequantization(tmp_path: Path, tokenizer_dir: Path) -> None:
    assert_same_weights(write_gguf(tmp_path / "m.gguf", tokenizer_dir, wtype="Q6_K"),
                        torch.bfloat16)


def test_tokenizer_and_template_come_from_the_file(tmp_path: Path, tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    path = write_gguf(tmp_path / "m.gguf", tokenizer_dir)
    ours = load_tokenizer(resolve_model_dir(str(tmp_path), show_progress=False))  # the folder
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f(x):"}]
    ours_ids = ours.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert ours_ids == ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    text = "import os\nprint(os.getcwd())  # café"
    assert ours.encode(text) == ref.encode(text)
    assert ours.eos_token_id == 2


def test_converted_folder_is_cached(tmp_path: Path, tokenizer_dir: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", tokenizer_dir)
    first = resolve_model_dir(str(path), show_progress=False)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_dir(str(path), show_progress=False) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # not written again


def test_clear_errors(tmp_path: Path, tokenizer_dir: Path) -> None:
    with pytest.raises(ValueError, match="ggml type IQ2_XXS"):
        check_supported(Q.IQ2_XXS, "blk.0.attn_q.weight")
    assert "Q4_K" in SUPPORTED_TYPES
    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="architecture 'gpt2'"):
        open_gguf(tmp_path / "gpt2.gguf")
    write_gguf(tmp_path / "second.gguf", tokenizer_dir)
    with pytest.raises(ValueError, match="2 .gguf files"):
        find_gguf(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_dir(str(tmp_path / "missing.gguf"))
