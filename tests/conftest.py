"""Tiny random models in Hugging Face format, built once per test session (nothing downloaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from banyan.demo import build_random_model, train_tokenizer

# Larger init than HF's default 0.02 spreads the logits, so greedy argmax is far from ties and
# float32 rounding differences between implementations cannot flip a token.
_COMMON: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=1024,
    initializer_range=0.1,
)
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    # llama3 rope scaling with a short original context so positions past 64 are scaled.
    "llama": dict(_COMMON, num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                  rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    # MQA and a head_dim that is not hidden / heads.
    "mistral": dict(_COMMON, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                    sliding_window=None),
    # q/k/v bias and tied embeddings.
    "qwen2": dict(_COMMON, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    # q/k RMSNorm and an explicit head_dim.
    "qwen3": dict(_COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  tie_word_embeddings=False),
}
ARCHS = list(TINY_CONFIGS)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(out, vocab_size=512, corpus_bytes=400_000)
    return out


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> dict[str, Path]:
    """{"llama", "mistral", "qwen2", "qwen3"} -> folder with a random float32 model + tokenizer."""
    dirs = {}
    for arch, config in TINY_CONFIGS.items():
        out = tmp_path_factory.mktemp(f"tiny-{arch}")
        dirs[arch] = build_random_model(out, arch, tokenizer_dir=tokenizer_dir, **config)
    return dirs


@pytest.fixture(scope="session")
def llama_dir(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["llama"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
