"""Finding a model folder and loading its tokenizer: no torch, no model code, so the API server
process can use them without importing the runner."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


DEMO_MODEL = "demo"  # --model demo: the random-weight demo model (tests, quick checks)
DEMO_SERVED_NAME = "banyan-demo"


def resolve_model_dir(model: str | None, show_progress: bool = True) -> Path:
    """The Hugging Face folder to load: `model` itself, the converted copy of a GGUF file (or of
    the one .gguf in a folder), the demo model for "demo", SmolLM2-135M-Instruct for None."""
    from banyan.models.gguf_loader import default_model_file, find_gguf, gguf_model_dir

    if model == DEMO_MODEL and not Path(model).exists():
        from banyan.demo import demo_model_dir

        logger.warning("Using the demo model (random weights: its text is meaningless).")
        return demo_model_dir()
    path = default_model_file() if model is None else Path(model).expanduser()
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        return gguf_model_dir(gguf_file, show_progress)
    if not path.is_dir():
        raise ValueError(f"model folder or GGUF file {model!r} does not exist "
                         "(Banyan loads local files only)")
    if not (path / "config.json").exists():
        raise ValueError(f"model folder {model!r} has no config.json and no .gguf file")
    return path


def engine_model_arg(model: str | None, model_dir: Path) -> str | None:
    """What engine processes get as --model once the launcher resolved it to model_dir: the
    demo model's folder (built once, by the launcher), else the value as given, so a GGUF file
    (or the default model's) keeps its blocks: given only the converted folder, the engine
    would run the dequantized weights."""
    return str(model_dir) if model == DEMO_MODEL and not Path(model).exists() else model


def gguf_source(model: str | None) -> Path | None:
    """The GGUF file a --model value loads from (None: the default model's file), or None when
    it names a Hugging Face folder or the demo model."""
    from banyan.models.gguf_loader import default_model_file, find_gguf

    if model == DEMO_MODEL and not Path(model).exists():
        return None
    path = default_model_file() if model is None else Path(model).expanduser()
    return find_gguf(path)


def default_served_name(model: str | None) -> str:
    """The name the server answers to when --served-model-name is not given."""
    from banyan.models.gguf_loader import DEFAULT_MODEL_NAME

    if model is None:
        return DEFAULT_MODEL_NAME
    return DEMO_SERVED_NAME if model == DEMO_MODEL else model


SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_config(path: Path) -> dict[str, Any]:
    """A model folder's generation_config.json as read ({} without one, or a bad one)."""
    file = path / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        logger.warning("ignoring %s: %s", file, exc)
        return {}
    return config if isinstance(config, dict) else {}


def sampling_defaults(path: Path) -> dict[str, float]:
    """The sampling settings generation_config.json recommends (only those it names), which the
    server applies where a request is silent, as vLLM does; {} without the file."""
    config = generation_config(path)
    found = {k: float(config[k]) for k in SAMPLING_DEFAULT_KEYS
             if isinstance(config.get(k), (int, float)) and not isinstance(config.get(k), bool)}
    if found:
        logger.info("sampling defaults from generation_config.json: %s", found)
    return found


# Classes AutoTokenizer resolves to the generic fast tokenizer: loaded as that class directly,
# since AutoTokenizer first imports transformers' model registry and torch (5.7 s against
# 1.5 s for SmolLM2's tokenizer on Zen 3, in the API server and the engine at every start).
GENERIC_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def tokenizer_class_name(path: Path) -> str | None:
    """The tokenizer_class a folder's tokenizer_config.json names (None: none, or no file)."""
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    return name if isinstance(name, str) else None


def load_tokenizer(path: Path) -> Any:
    if tokenizer_class_name(path) in GENERIC_TOKENIZER_CLASSES and \
            (path / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast as loader
    else:
        from transformers import AutoTokenizer as loader  # type: ignore[assignment]

    try:
        return loader.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types here
        raise ValueError(f"cannot load a tokenizer from {str(path)!r}: {exc}") from exc


# tokenizer_config.json's named special tokens (transformers' SPECIAL_TOKENS_ATTRIBUTES)
_NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                   "mask_token")
_LISTED_SPECIALS = ("additional_special_tokens", "extra_special_tokens")


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):  # a serialised AddedToken
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class EngineTokenizer:
    """What the engine needs of a generic fast tokenizer (token bytes, decodes, the EOS id) from
    its tokenizer.json alone: the Rust tokenizer with the special tokens tokenizer_config.json
    adds, as transformers marks them, without importing transformers (1.6 s of an engine's
    3 s start on Zen 3). `hf()` loads the transformers tokenizer once, when something needs it
    (a grammar compiler, the offline API)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import AddedToken, Tokenizer

        self.path = path
        try:
            self.backend_tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
            config = json.loads((path / "tokenizer_config.json").read_text())
        except Exception as exc:  # noqa: BLE001 - tokenizers' errors are plain Exceptions
            raise ValueError(f"cannot load a tokenizer from {str(path)!r}: {exc}") from exc
        decoder = config.get("added_tokens_decoder") or {}
        for key in sorted(decoder, key=int):  # in id order, one by one: the ids they get
            e = decoder[key]
            token = AddedToken(e["content"], single_word=e.get("single_word", False),
                               lstrip=e.get("lstrip", False), rstrip=e.get("rstrip", False),
                               normalized=e.get("normalized", False),
                               special=e.get("special", False))
            add = self.backend_tokenizer.add_special_tokens if token.special else \
                self.backend_tokenizer.add_tokens
            add([token])
        names = [config.get(k) for k in _NAMED_SPECIALS]
        for key in _LISTED_SPECIALS:
            listed = config.get(key) or []
            names += list(listed.values()) if isinstance(listed, dict) else list(listed)
        self.backend_tokenizer.add_special_tokens(
            [AddedToken(c, special=True, normalized=False)
             for c in map(_token_content, names) if c is not None])
        eos = _token_content(config.get("eos_token"))
        self.eos_token_id: int | None = (self.backend_tokenizer.token_to_id(eos)
                                         if eos is not None else None)
        self._hf: Any = None
        self._lock = threading.Lock()

    def hf(self) -> Any:
        with self._lock:
            if self._hf is None:
                self._hf = load_tokenizer(self.path)
            return self._hf


def load_engine_tokenizer(path: Path) -> Any:
    """An EngineTokenizer where the folder's tokenizer is the generic fast one, else the
    transformers tokenizer (a class of its own may decode differently)."""
    if tokenizer_class_name(path) in GENERIC_TOKENIZER_CLASSES and \
            (path / "tokenizer.json").is_file():
        return EngineTokenizer(path)
    return load_tokenizer(path)


def hf_tokenizer(tokenizer: Any) -> Any:
    """The transformers tokenizer behind what load_engine_tokenizer returned."""
    return tokenizer.hf() if isinstance(tokenizer, EngineTokenizer) else tokenizer
