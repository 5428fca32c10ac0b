"""Writing small GGUF models with gguf's GGUFWriter, for the GGUF tests (test_gguf.py: loading;
test_gguf_linear.py: --quantization gguf)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np

from banyan.demo import CHATML_TEMPLATE

Q = gguf.GGMLQuantizationType

HIDDEN, INTER, LAYERS = 256, 512, 2  # K-quants need rows of 256
# (heads, kv heads): head_dim 64, except qwen3, where transformers ignores the file's key_length
# and keeps its default head_dim of 128 (Banyan reads key_length; the oracle must agree).
HEADS = {"llama": (4, 2), "qwen2": (4, 2), "qwen3": (2, 1)}
# f16 fields (scales d, dmin, m) inside one block of the types gguf cannot quantize in Python:
# random bytes elsewhere are valid quants; the scales are set to small finite numbers.
_K_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def encode(x: np.ndarray, type_name: str, rng: np.random.Generator) -> np.ndarray:
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
               seed: int = 0, tied: bool = False, embed_type: str | None = None,
               types: dict[str, str] | None = None) -> Path:
    """A 2-layer `arch` model whose matrices are all of ggml type `wtype` (the embedding of
    `embed_type` when given; a layer tensor named in `types`, e.g. {"attn_v": "Q8_0"}, of
    that type, as llama.cpp's mixes do), with the tests' BPE tokenizer and a ChatML template
    in its metadata; tied: no output.weight (the LM head is the embedding, as in SmolLM2's)."""
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

    def matrix(name: str, rows: int, cols: int, kind: str = wtype) -> None:
        kind = (types or {}).get(name.split(".")[-2], kind)
        x = rng.normal(0, 0.1, (rows, cols)).astype(np.float32)
        data = encode(x, kind, rng)
        if kind in ("F32", "F16"):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=Q[kind])

    def vector(name: str, n: int, mean: float = 0.0) -> None:
        w.add_tensor(name, (mean + rng.normal(0, 0.1, n)).astype(np.float32))

    matrix("token_embd.weight", len(tokens), HIDDEN, embed_type or wtype)
    vector("output_norm.weight", HIDDEN, 1.0)
    if not tied:
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


