"""Load a Hugging Face Llama-family checkpoint (safetensors, single or sharded) into our model.

The model is built on the meta device (no memory), its parameters are then allocated empty on
the target device in the target dtype, and each checkpoint tensor is read and copied into place
one at a time: peak host memory is the model plus one tensor, never two copies of the model.
Fused parameters (qkv_proj, gate_up_proj) are filled slice by slice; every error names the
Hugging Face tensor.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from banyan.layers.linear import dense_weight_loader
from banyan.models.config import ModelConfig, resolve_dtype
from banyan.models.llama import LlamaForCausalLM, WeightSlot

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a model folder (the shards named by the index, in order)."""
    root = Path(folder)
    index = root / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [root / name for name in dict.fromkeys(sorted(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{INDEX_FILE} names {f.name}, which is not in {root}")
        return files
    if (root / SINGLE_FILE).is_file():
        return [root / SINGLE_FILE]
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {root}")


def load_model(
    path: str | Path,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    show_progress: bool = True,
    config: ModelConfig | None = None,
    not_read: Callable[[LlamaForCausalLM], set[str]] | None = None,
) -> LlamaForCausalLM:
    """Build and fill the model from a local HF folder. dtype: None/'auto' = the config's.
    not_read(model on meta) -> checkpoint tensors left unread (their parameters uninitialised):
    weights the caller replaces right after, such as linears computed from GGUF blocks."""
    cfg = config or ModelConfig.from_pretrained(path)
    dtype = resolve_dtype(dtype, cfg.torch_dtype)
    device = torch.device(device)
    files = checkpoint_files(path)  # before building anything: fail fast on a bad folder
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    skip = not_read(model) if not_read is not None else set()
    materialize(model, dtype, device)
    fill_from_safetensors(
        model,
        model.checkpoint_layout(),
        files,
        tied=cfg.tie_word_embeddings,
        show_progress=show_progress,
        skip=skip,
    )
    model.eval()
    logger.info(
        "loaded %s (%s, %d layers) from %s as %s on %s",
        cfg.model_type,
        _human(sum(p.numel() for p in model.parameters())),
        cfg.layers,
        path,
        dtype,
        device,
    )
    return model


def materialize(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Give every meta parameter real, uninitialised storage (dtype, device); move real buffers
    (RoPE inv_freq, kept float32) to the device. Shared parameters stay shared."""
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in done:
                done[id(param)] = nn.Parameter(
                    torch.empty(param.shape, dtype=dtype, device=device), requires_grad=False
                )
                if hasattr(param, "weight_loader"):  # the layer's own way to load it
                    done[id(param)].weight_loader = param.weight_loader  # type: ignore[attr-defined]
            module._parameters[name] = done[id(param)]
        for name, buf in list(module._buffers.items()):
            if buf is not None:
                if buf.is_meta:
                    raise RuntimeError(
                        f"buffer {name} of {type(module).__name__} was built on meta"
                    )
                module._buffers[name] = buf.to(device)


def fill_from_safetensors(
    model: nn.Module,
    layout: dict[str, WeightSlot],
    files: list[Path],
    tied: bool,
    show_progress: bool = True,
    skip: set[str] | None = None,
) -> None:
    """Copy every checkpoint tensor into its slot of `model` (but those in `skip`); ValueError
    naming any tensor that is missing, unexpected or of the wrong shape."""
    from safetensors import safe_open

    params = dict(model.named_parameters(remove_duplicate=False))
    seen: set[str] = set()
    unexpected: list[str] = []
    with ExitStack() as stack:
        handles = [
            stack.enter_context(safe_open(str(f), framework="pt", device="cpu")) for f in files
        ]
        _fill(params, layout, files, handles, tied, show_progress, seen, unexpected,
              skip or set())
    if unexpected:
        raise ValueError(f"unexpected tensors in checkpoint: {_names(unexpected)}")
    missing = [name for name in layout if name not in seen]
    if missing:
        raise ValueError(f"tensors missing from checkpoint: {_names(missing)}")


def _fill(
    params: dict[str, nn.Parameter],
    layout: dict[str, WeightSlot],
    files: list[Path],
    handles: list[Any],
    tied: bool,
    show_progress: bool,
    seen: set[str],
    unexpected: list[str],
    skip: set[str],
) -> None:
    total = sum(len(h.keys()) for h in handles)
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not show_progress) as bar:
        for f, handle in zip(files, handles, strict=True):
            for name in handle.keys():
                bar.update(1)
                if _ignored(name, tied):
                    continue
                if name in skip and name in layout:
                    seen.add(name)
                    continue
                slot = layout.get(name)
                if slot is None:
                    unexpected.append(name)
                    continue
                param = params[slot.param]
                loader = getattr(param, "weight_loader", dense_weight_loader)
                try:
                    loader(param, handle.get_tensor(name), slot.start, slot.rows)
                except ValueError as exc:
                    raise ValueError(f"tensor {name!r} in {f.name}: {exc}") from None
                seen.add(name)


def _ignored(name: str, tied: bool) -> bool:
    # Old checkpoints saved RoPE buffers; tied models may still carry a copy of the embeddings.
    return name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight")


def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _human(n: int) -> str:
    return f"{n / 1e9:.2f}B params" if n >= 1e9 else f"{n / 1e6:.1f}M params"
