"""Loader errors name the Hugging Face tensor; sharded and bf16 checkpoints; runner set-up."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from banyan.batch import ForwardBatch
from banyan.demo import build_random_model
from banyan.mem.allocator import SlotAllocator
from banyan.models.config import ModelConfig
from banyan.models.loader import load_model
from banyan.runner.model_runner import ModelRunner
from tests.model_helpers import (
    VOCAB,
    Seq,
    assert_close,
    hf_logits,
    make_runner,
    random_ids,
    run_step,
)


def copy_model(src: Path, dst: Path, **config_changes: object) -> Path:
    shutil.copytree(src, dst)
    if config_changes:
        cfg_path = dst / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.update(config_changes)
        cfg_path.write_text(json.dumps(cfg))
    return dst


def rewrite_weights(folder: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    from safetensors.torch import load_file, save_file

    file = folder / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_unsupported_model_type(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = copy_model(
        model_dirs["llama"],
        tmp_path / "m",
        model_type="gpt_neox",
        architectures=["GPTNeoXForCausalLM"],
    )
    with pytest.raises(ValueError, match="gpt_neox"):
        ModelConfig.from_pretrained(path)


def test_dynamic_rope_refused(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = copy_model(
        model_dirs["llama"],
        tmp_path / "m",
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
        rope_parameters=None,
    )
    with pytest.raises(ValueError, match="dynamic"):
        ModelConfig.from_pretrained(path)


def test_missing_tensor_named(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = copy_model(model_dirs["qwen2"], tmp_path / "m")
    rewrite_weights(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.self_attn\.k_proj\.bias"):
        load_model(path, show_progress=False)


def test_unexpected_tensor_named(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = copy_model(model_dirs["llama"], tmp_path / "m")
    rewrite_weights(path, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"unexpected.*model\.layers\.0\.mlp\.extra\.weight"):
        load_model(path, show_progress=False)


def test_shape_mismatch_named(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = copy_model(model_dirs["mistral"], tmp_path / "m")

    def shrink(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:-1].clone()

    rewrite_weights(path, shrink)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*shape"):
        load_model(path, show_progress=False)


def test_untied_model_needs_lm_head(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = copy_model(model_dirs["qwen3"], tmp_path / "m")
    rewrite_weights(path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_model(path, show_progress=False)


def test_sharded_checkpoint(tmp_path: Path, tokenizer_dir: Path) -> None:
    path = build_random_model(
        tmp_path / "sharded",
        "qwen3",
        tokenizer_dir=tokenizer_dir,
        seed=5,
        max_shard_size="60KB",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        initializer_range=0.1,
    )
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("model-*.safetensors"))) > 1
    runner = make_runner(path)
    ids = random_ids(30, seed=9)
    (got,) = run_step(runner, SlotAllocator(runner.num_slots), [(Seq(0, ids), len(ids))])
    assert_close(got, hf_logits(path, ids), what="sharded")


def test_runner_validates_batches(model_dirs: dict[str, Path]) -> None:
    runner = make_runner(model_dirs["llama"], num_slots=64, max_rows=2, max_context=32)
    good = dict(rows=[0], prefix_lens=[0], extend_lens=[2], input_ids=[5, 6], out_slots=[1, 2])
    runner.forward(ForwardBatch(**good))  # type: ignore[arg-type]
    bad: list[dict[str, object]] = [
        dict(good, rows=[2]),  # no such row
        dict(good, out_slots=[1, 64]),  # no such slot
        dict(good, input_ids=[5, VOCAB]),  # no such token
        dict(good, prefix_lens=[31]),  # past max_context
        dict(good, extend_lens=[3]),  # lengths disagree
        dict(good, sample_indices=[1]),
    ]
    for fields in bad:
        with pytest.raises(ValueError):
            runner.forward(ForwardBatch(**fields))  # type: ignore[arg-type]


def test_from_engine_args(model_dirs: dict[str, Path]) -> None:
    from banyan.args import EngineArgs

    args = EngineArgs(
        model=str(model_dirs["qwen2"]),
        kv_cache_memory="64KiB",
        max_model_len=100,
        max_running_requests=3,
        disable_tqdm=True,
    )
    runner = ModelRunner.from_engine_args(args)
    assert runner.num_slots == 64 * 1024 // runner.bytes_per_token
    assert runner.table.table.shape == (3, 100) and runner.device == torch.device("cpu")
    # No explicit size: a fraction of free memory, capped at what the table can ever reference.
    args = EngineArgs(
        model=str(model_dirs["qwen2"]), max_model_len=50, max_running_requests=2, disable_tqdm=True
    )
    assert ModelRunner.from_engine_args(args).num_slots == 2 * 50 + 1


def test_kv_budget_sizes_pool(model_dirs: dict[str, Path]) -> None:
    cfg = ModelConfig.from_pretrained(model_dirs["mistral"])
    per_slot = cfg.layers * 2 * cfg.kv_heads * cfg.head_dim * 4
    runner = make_runner(model_dirs["mistral"], num_slots=None, kv_cache_bytes=per_slot * 100 + 7)
    assert runner.num_slots == 100
    assert runner.bytes_per_token == per_slot


def test_plain_configs_read_without_autoconfig(model_dirs: dict[str, Path],
                                               tmp_path: Path) -> None:
    """A config.json that names every field read whose class default matters, its RoPE
    unscaled, linear or llama3, is read as it is (no AutoConfig), for every family: the same
    ModelConfig and EOS ids as through AutoConfig. A field left to a class default that
    matters, or YaRN, goes through AutoConfig."""
    from transformers import AutoConfig

    from banyan.models import config as config_module

    def both(folder: Path) -> tuple[ModelConfig, ModelConfig]:
        fast = ModelConfig.from_pretrained(folder)
        slow = ModelConfig.from_hf_config(AutoConfig.from_pretrained(str(folder)))
        return fast, slow

    def fields(cfg: ModelConfig) -> dict[str, object]:
        return {k: getattr(cfg, k) for k in ModelConfig.__slots__ if k != "hf_config"}

    def variant(arch: str, change: dict[str, object], drop: str = "") -> Path:
        raw = json.loads((model_dirs[arch] / "config.json").read_text())
        path = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
        shutil.copytree(model_dirs[arch], path)
        raw = {k: v for k, v in {**raw, **change}.items() if k != drop}
        (path / "config.json").write_text(json.dumps(raw))
        return path

    legacy = {"rope_parameters": None, "rope_theta": 50000.0,
              "rope_scaling": {"type": "linear", "factor": 2.0}}
    cases = [model_dirs[arch] for arch in ("llama", "mistral", "qwen2", "qwen3")] + [
        variant("llama", {"rope_parameters": {"rope_theta": 50000.0, "rope_type": "default"}}),
        variant("qwen2", legacy), variant("mistral", {"sliding_window": 4096}),
        variant("qwen3", {"use_sliding_window": True, "sliding_window": 512}),
    ]
    for folder in cases:
        fast, slow = both(folder)
        assert not hasattr(fast.hf_config, "to_dict"), folder  # the plain path was taken
        assert fields(fast) == fields(slow), folder
        assert fast.hf_config.eos_token_id == slow.hf_config.eos_token_id
    assert fast.sliding_window == 512 and both(cases[-3])[0].rope_theta == 50000.0
    yarn = variant("llama", {"rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "rope_theta": 10000.0}})
    fast, slow = both(yarn)
    assert hasattr(fast.hf_config, "to_dict") and fields(fast) == fields(slow)
    for arch, key in [("llama", "rms_norm_eps"), ("llama", "num_key_value_heads"),
                      ("mistral", "sliding_window"), ("qwen2", "use_sliding_window"),
                      ("qwen3", "head_dim"), ("qwen2", "eos_token_id")]:
        folder = variant(arch, {}, drop=key)
        assert config_module._plain_config(folder / "config.json") is None, (arch, key)
        fast, slow = both(folder)
        assert fields(fast) == fields(slow), (arch, key)
