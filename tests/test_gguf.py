"""GGUF loading on small files written here with gguf's GGUFWriter: every supported tensor type,
the architectures with their quirks (llama's permuted q/k rows, qwen2's biases, qwen3's q/k
norms), each compared weight for weight with transformers loading the same file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from banyan.model_files import load_tokenizer, resolve_model_dir
from banyan.models.gguf_dequant import QUANTIZED_TYPES, SUPPORTED_TYPES, check_supported
from banyan.models.gguf_loader import find_gguf, open_gguf
from banyan.models.loader import load_model

gguf = pytest.importorskip("gguf")
from tests.gguf_helpers import write_gguf  # noqa: E402  (needs gguf)
from tests.http_client import HTTP  # noqa: E402

Q = gguf.GGMLQuantizationType


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BANYAN_CACHE_DIR", str(tmp_path / "cache"))


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


def test_one_folder_per_content_and_stale_folders_removed(tmp_path: Path,
                                                          tokenizer_dir: Path) -> None:
    """A reinstall writes the same bytes with a new mtime: it reuses the folder (keyed by
    content; keyed by mtime, every install had left a 517 MB folder behind). Building a new
    folder removes those whose files are gone, and the old mtime-keyed kind."""
    import os
    import shutil

    first_dir, second_dir = tmp_path / "a", tmp_path / "b"
    first_dir.mkdir()
    second_dir.mkdir()
    path = write_gguf(first_dir / "m.gguf", tokenizer_dir)
    folder = resolve_model_dir(str(path), show_progress=False)
    copy = shutil.copy(path, second_dir / "m.gguf")  # another install: same bytes, new mtime
    os.utime(copy, ns=(1, 1))
    assert resolve_model_dir(str(copy), show_progress=False) == folder
    root = folder.parent
    old_kind = root / f"m-{path.stat().st_size}-1796373430220332270-v1"  # mtime-keyed
    old_kind.mkdir()
    other = write_gguf(tmp_path / "other.gguf", tokenizer_dir, wtype="Q4_0")
    other_folder = resolve_model_dir(str(other), show_progress=False)
    assert other_folder != folder and not old_kind.exists() and folder.is_dir()
    path.unlink()
    Path(copy).unlink()  # both files of the first folder gone: the next build removes it
    third = write_gguf(tmp_path / "third.gguf", tokenizer_dir, wtype="Q6_K")
    resolve_model_dir(str(third), show_progress=False)
    assert not folder.exists() and other_folder.is_dir()


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


def test_header_reader_gives_what_ggufs_reader_gives(tmp_path: Path, tokenizer_dir: Path) -> None:
    """GGUFHeader (read at every start of a server computing from blocks) against gguf's own
    reader: the same tensors (names, types, dims, data typed and shaped alike, bytes equal) and
    the same scalar and string metadata; arrays (the tokenizer's tokens) are stepped over."""
    import numpy as np

    from banyan.models.gguf_header import GGUFHeader, SkippedArray

    path = write_gguf(tmp_path / "mixed.gguf", tokenizer_dir, wtype="Q4_K",
                      types={"attn_v": "Q8_0", "ffn_down": "F16", "attn_k": "BF16"})
    ours, theirs = GGUFHeader(path), gguf.GGUFReader(str(path))
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    kinds = set()
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert a.tensor_type == b.tensor_type and a.shape.tolist() == b.shape.tolist()
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data, b.data), a.name
        kinds.add(a.tensor_type)
    assert len(kinds) >= 4
    arrays = 0
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue  # the reader's own entries for the header's counts
        value = ours.fields[key]
        if isinstance(value, SkippedArray):
            assert value.count == len(field.data)
            arrays += 1
        else:
            assert value == field.contents(), key
    assert arrays >= 2  # the tokenizer's tokens and merges were stepped over
    (tmp_path / "bad.gguf").write_bytes(b"GGUX" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFHeader(tmp_path / "bad.gguf")


def test_a_served_gguf_file_computes_from_its_blocks(tmp_path: Path, tokenizer_dir: Path) -> None:
    """`banyan serve --model file.gguf`: the engine process computes from the file's blocks
    (it was handed the dequantized folder once, and ran float32 weights)."""
    from tests.server_helpers import start_server

    path = write_gguf(tmp_path / "served.gguf", tokenizer_dir, wtype="Q4_0")
    server = start_server(path, tmp_path)
    try:
        info = HTTP.get(f"{server.url}/server_info", timeout=30).json()
        assert info["quantization"] == "gguf" and info["engine_args"]["model"] == str(path)
    finally:
        server.stop()


def test_generic_tokenizers_load_as_autotokenizer_loads_them(tmp_path: Path,
                                                             tokenizer_dir: Path) -> None:
    """load_tokenizer skips AutoTokenizer (and its import of torch) for the classes it resolves
    to the generic fast tokenizer: the same class, ids, special tokens and chat template."""
    from transformers import AutoTokenizer

    from banyan.model_files import GENERIC_TOKENIZER_CLASSES, tokenizer_class_name

    folder = resolve_model_dir(str(write_gguf(tmp_path / "t.gguf", tokenizer_dir)),
                               show_progress=False)
    assert tokenizer_class_name(folder) in GENERIC_TOKENIZER_CLASSES
    ours, auto = load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    assert type(ours) is type(auto)
    text = "Once upon a time, naïve café 😀 <|im_end|> and\n\ttabs"
    assert ours.encode(text) == auto.encode(text)
    assert ours.all_special_ids == auto.all_special_ids and ours.eos_token == auto.eos_token
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert ours.apply_chat_template(chat, tokenize=False) == \
        auto.apply_chat_template(chat, tokenize=False)
