"""The engine's tokenizer without transformers: the Rust tokenizer plus tokenizer_config.json's
special tokens must decode, flag specials and name EOS exactly as transformers' loaded one."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from banyan.engine.byte_detok import TokenBytes
from banyan.model_files import (
    EngineTokenizer,
    hf_tokenizer,
    load_engine_tokenizer,
    load_tokenizer,
)
from tests.test_detok import train_metaspace_tokenizer


def _metaspace_dir(tmp_path: Path) -> Path:
    """A Llama-2-like tokenizer whose config names specials the tokenizer.json does not flag:
    an extra special that is an ordinary vocabulary token, and an added one of its own."""
    out = tmp_path / "metaspace"
    train_metaspace_tokenizer().save_pretrained(str(out))
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["pad_token"] = {"content": "<0x41>", "special": True, "__type": "AddedToken"}
    config["added_tokens_decoder"] = {"656": {"content": "<tool>", "special": True,
                                              "lstrip": False, "rstrip": False,
                                              "normalized": False, "single_word": False},
                                      "657": {"content": "plain-added", "special": False}}
    config_path.write_text(json.dumps(config))
    return out


@pytest.fixture(params=["bytelevel", "metaspace", "smollm2"])
def folder(request: pytest.FixtureRequest, tokenizer_dir: Path, tmp_path: Path) -> Path:
    if request.param == "bytelevel":
        return tokenizer_dir
    if request.param == "metaspace":
        return _metaspace_dir(tmp_path)
    from banyan.model_files import resolve_model_dir

    try:
        return resolve_model_dir(None, show_progress=False)
    except ValueError as exc:
        pytest.skip(f"no default model: {exc}")


def _added(tok: Any) -> dict[int, tuple[str, bool]]:
    backend = tok.backend_tokenizer
    return {i: (t.content, t.special) for i, t in backend.get_added_tokens_decoder().items()}


def test_the_engine_tokenizer_is_transformers_without_transformers(folder: Path) -> None:
    light, hf = load_engine_tokenizer(folder), load_tokenizer(folder)
    assert isinstance(light, EngineTokenizer)
    assert _added(light) == _added(hf) and light.eos_token_id == hf.eos_token_id
    assert any(special for _, special in _added(light).values())
    vocab = hf.backend_tokenizer.get_vocab_size(with_added_tokens=True)
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 24))]
        for skip in (True, False):
            assert light.backend_tokenizer.decode(ids, skip_special_tokens=skip) == \
                hf.backend_tokenizer.decode(ids, skip_special_tokens=skip), ids
    table, want = TokenBytes.of(light), TokenBytes.of(hf)
    assert (table is None) == (want is None)
    if table is not None and want is not None:
        assert table.table == want.table and table.special == want.special


def test_the_full_tokenizer_is_loaded_once_on_demand(tokenizer_dir: Path) -> None:
    light = load_engine_tokenizer(tokenizer_dir)
    full = hf_tokenizer(light)
    assert isinstance(full, PreTrainedTokenizerFast) and hf_tokenizer(light) is full
    assert hf_tokenizer(full) is full


def test_a_tokenizer_of_its_own_class_stays_transformers(tokenizer_dir: Path,
                                                         tmp_path: Path) -> None:
    other = tmp_path / "own-class"
    other.mkdir()
    for f in tokenizer_dir.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "GPT2TokenizerFast"
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    assert not isinstance(load_engine_tokenizer(other), EngineTokenizer)


def test_a_broken_tokenizer_json_is_a_value_error(tokenizer_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer_config.json").write_bytes(
        (tokenizer_dir / "tokenizer_config.json").read_bytes())
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        load_engine_tokenizer(broken)


def test_the_default_engine_is_built_without_importing_transformers() -> None:
    """The served default model's start: tokenizer, EOS ids, config, GGUF blocks, and not
    transformers (1.6 s of import on Zen 3)."""
    from banyan.models.gguf_loader import default_model_file

    try:
        default_model_file()
    except ValueError as exc:
        pytest.skip(f"no default model: {exc}")
    code = ("import sys\nfrom banyan.args import EngineArgs\n"
            "from banyan.engine.build import build_engine_core\n"
            "core = build_engine_core(EngineArgs(kv_cache_memory='8MiB', disable_tqdm=True))\n"
            "assert core.eos_ids, core.eos_ids\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n")
    # (~5-14 s; a clean clone on a stalled Zen 1 VM once passed 120 s here, where the rest of
    # its suite ran 1.3x slower: the bound only stops a hang)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr
