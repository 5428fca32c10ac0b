"""What Banyan needs to know about a Llama-family checkpoint, read from its config.json.

Parsed through `transformers.AutoConfig` (local folder only, never a download) so that every
default and legacy spelling (e.g. `rope_scaling` vs `rope_parameters`) is resolved exactly as
the reference implementation resolves it. The HF config object is kept for the RoPE init
function of YaRN, which takes it as its argument. Except for the plain case: a config.json
that spells out every field read here whose class default matters, with RoPE unscaled, linear
or llama3 (computed in rotary.py, tested equal to transformers'), is read as it is:
AutoConfig's import costs ~4 s of each engine start on a slow CPU (tested to give the same
ModelConfig for every family).

Sliding-window attention (Mistral's `sliding_window`, Qwen's `use_sliding_window`) is ignored:
every layer attends to the full context. This equals the reference as long as sequences stay
within the window (4096+ tokens for the released models); a warning is logged at load time when
a window shorter than `max_position_embeddings` is configured.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from banyan.layers.rotary import SUPPORTED_ROPE_TYPES

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# A config.json giving all of these (not null) is read without AutoConfig: their class
# defaults differ between the families, or from the fallbacks of `from_hf_config`.
_PLAIN_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
               "intermediate_size", "vocab_size", "rms_norm_eps", "max_position_embeddings",
               "eos_token_id")
# Per family, more keys it must name (null allowed): Qwen3's head_dim defaults to 128, not
# hidden / heads; Mistral's window to 4096; Qwen's windows count only with use_sliding_window,
# which `_sliding_window` takes as true when a config does not name it.
_PLAIN_FAMILY_KEYS = {"llama": (), "mistral": ("sliding_window",),
                      "qwen2": ("use_sliding_window",), "qwen3": ("head_dim", "use_sliding_window")}
# RoPE kinds rotary.py computes itself; YaRN's parameters are standardised by transformers.
_PLAIN_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(slots=True)
class ModelConfig:
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rms_eps: float
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (qwen2 always; llama/qwen3 `attention_bias`)
    o_proj_bias: bool  # bias on o_proj (llama/qwen3 `attention_bias`; never qwen2)
    mlp_bias: bool  # llama's `mlp_bias`
    qk_norm: bool  # qwen3: per-head RMSNorm of q and k before RoPE
    max_position_embeddings: int
    torch_dtype: torch.dtype  # the checkpoint's dtype (float32 when the config names none)
    rope_parameters: dict[str, Any]  # rope_type, rope_theta and the scaled kinds' parameters
    sliding_window: int | None  # recorded, not applied (see module doc)
    # transformers' PreTrainedConfig (YaRN's RoPE init takes it), or config.json's fields as
    # attributes where it was read without AutoConfig
    hf_config: Any

    @property
    def rope_type(self) -> str:
        return str(self.rope_parameters["rope_type"])

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters["rope_theta"])

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        folder = Path(path)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(
                f"no config.json in {folder} (a local Hugging Face model folder)"
            )
        plain = _plain_config(folder / "config.json")
        if plain is not None:
            return cls.from_hf_config(plain)
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(str(folder), local_files_only=True)
        return cls.from_hf_config(hf)

    @classmethod
    def from_hf_config(cls, hf: Any) -> ModelConfig:
        model_type = getattr(hf, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; "
                f"Banyan supports {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        hidden = int(hf.hidden_size)
        heads = int(hf.num_attention_heads)
        kv_heads = int(getattr(hf, "num_key_value_heads", None) or heads)
        if heads % kv_heads:
            raise ValueError(
                f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        # Same rule as the HF modules: an explicit head_dim wins (Mistral/Qwen3 may set one that
        # is not hidden/heads).
        head_dim = int(getattr(hf, "head_dim", None) or hidden // heads)
        rope = _rope_parameters(hf)
        attn_bias_flag = bool(getattr(hf, "attention_bias", False))
        sliding = _sliding_window(hf)
        max_pos = int(hf.max_position_embeddings)
        if sliding is not None and sliding < max_pos:
            logger.warning(
                "%s: sliding_window=%d is ignored; sequences longer than it will differ "
                "from the reference",
                model_type,
                sliding,
            )
        return cls(
            model_type=model_type,
            hidden=hidden,
            layers=int(hf.num_hidden_layers),
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate=int(hf.intermediate_size),
            vocab=int(hf.vocab_size),
            rms_eps=float(hf.rms_norm_eps),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=True if model_type == "qwen2" else attn_bias_flag,
            o_proj_bias=False if model_type == "qwen2" else attn_bias_flag,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            max_position_embeddings=max_pos,
            torch_dtype=_config_dtype(hf),
            rope_parameters=rope,
            sliding_window=sliding,
            hf_config=hf,
        )


def resolve_dtype(name: str | torch.dtype | None, default: torch.dtype) -> torch.dtype:
    """'auto'/None -> default; 'bfloat16' or torch.bfloat16 -> torch.bfloat16."""
    if name is None or name == "auto":
        return default
    if isinstance(name, torch.dtype):
        if name not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {name}; use one of {sorted(_DTYPES)}")
        return name
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; use auto or one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def _config_dtype(hf: Any) -> torch.dtype:
    value = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
    if isinstance(value, str):
        value = _DTYPES.get(value)
    # A config naming no (or an exotic) dtype: float32 is always exact.
    return value if value in _DTYPES.values() else torch.float32


def _plain_config(path: Path) -> SimpleNamespace | None:
    """config.json as attributes when AutoConfig would add nothing Banyan reads: a supported
    family naming every key of _PLAIN_KEYS and of its _PLAIN_FAMILY_KEYS, with a RoPE kind
    computed here."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or raw.get("model_type") not in _PLAIN_FAMILY_KEYS:
        return None
    if any(raw.get(key) is None for key in _PLAIN_KEYS) or \
            any(key not in raw for key in _PLAIN_FAMILY_KEYS[raw["model_type"]]):
        return None
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rope, dict) or \
            (rope.get("rope_type") or rope.get("type") or "default") not in _PLAIN_ROPE_TYPES:
        return None
    return SimpleNamespace(**raw)


def _rope_parameters(hf: Any) -> dict[str, Any]:
    params = getattr(hf, "rope_parameters", None)
    if params is None:  # transformers < 5: rope_theta + rope_scaling
        params = dict(getattr(hf, "rope_scaling", None) or {})
    if "full_attention" in params:  # per-layer-type parameters: not used by this family
        raise ValueError("per-layer-type rope_parameters are not supported")
    params = dict(params)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "dynamic":
        raise ValueError(
            "rope_type 'dynamic' (dynamic NTK scaling) is not supported: its frequencies "
            "change with the sequence length; use 'linear', 'llama3' or 'yarn'"
        )
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported for the Llama family")
    params["rope_type"] = rope_type
    # (every family's class default is 10,000; a config.json may name it beside the parameters)
    params.setdefault("rope_theta", getattr(hf, "rope_theta", None) or 10000.0)
    return params


def _sliding_window(hf: Any) -> int | None:
    window = getattr(hf, "sliding_window", None)
    if window is None:
        return None
    if getattr(hf, "use_sliding_window", True) is False:  # qwen2/qwen3 keep the number around
        return None
    return int(window)
