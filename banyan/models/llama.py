"""The Llama family as one implementation: Llama 2/3, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norm).

Works on a flat token batch: all new tokens of all requests concatenated, [T], with their
positions. Attention goes through the backend carried by the step's metadata, which stores K/V
in the pool and reads each request's context back; the model holds no KV and no step state.

Projections are fused (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`): one GEMM instead of
three (two), which matters on CPU. `checkpoint_layout` tells the loader where each Hugging Face
tensor goes, so errors still name HF tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from banyan.attention.base import AttentionMetadata
from banyan.kernels import fused_ops
from banyan.layers.activation import silu_and_mul
from banyan.layers.linear import Linear
from banyan.layers.norm import RMSNorm
from banyan.layers.rotary import RotaryEmbedding, apply_rotary
from banyan.models.config import ModelConfig


@dataclass(slots=True, frozen=True)
class WeightSlot:
    """Where one checkpoint tensor lands: rows [start, start + rows) of parameter `param`
    (the whole parameter when rows is None)."""

    param: str
    start: int = 0
    rows: int | None = None


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = Linear(cfg.hidden, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden, bias=cfg.o_proj_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps) if cfg.qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        # x: [T, hidden]; cos/sin: [T, D/2]
        T = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        v = qkv[:, self.q_size + self.kv_size :].view(T, self.kv_heads, self.head_dim)
        qn, kn = self.q_norm, self.k_norm
        fused = fused_ops.rope_qk(  # one pass on CPU: q/k norms (Qwen3), RoPE, q made contiguous
            qkv, cos, sin, self.heads, self.kv_heads, self.head_dim,
            qn.weight if qn is not None else None,
            kn.weight if kn is not None else None,
            qn.eps if qn is not None else 0.0,
        )
        if fused is not None:
            q, k = fused  # [T, H, D], [T, KVH, D]
        elif qn is not None and kn is not None:
            q, k = qkv[:, : self.q_size + self.kv_size].split([self.q_size, self.kv_size], dim=-1)
            q = qn(q.reshape(T, self.heads, self.head_dim))  # Qwen3: before RoPE
            k = kn(k.reshape(T, self.kv_heads, self.head_dim))
            q = apply_rotary(q, cos, sin)  # [T, H, D]
            k = apply_rotary(k, cos, sin)  # [T, KVH, D]
        else:
            # q and k heads side by side in one rotation: half the element-wise ops
            qk = qkv[:, : self.q_size + self.kv_size].view(T, self.heads + self.kv_heads, -1)
            q, k = apply_rotary(qk, cos, sin).split([self.heads, self.kv_heads], dim=1)
        o = meta.backend.forward(q, k, v, self.layer_id, meta)  # [T, H, D]
        return self.o_proj(o.reshape(T, self.q_size))  # [T, hidden]


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden, 2 * cfg.intermediate, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate, cfg.hidden, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, 2I] -> [T, I] -> [T, hidden]
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.self_attn = LlamaAttention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # h: [T, hidden] the previous layer's output, residual: the stream it adds to (None for
        # the first layer, whose h is the embedding) -> (this layer's output, the stream).
        # Pre-norm residual blocks in HF's exact op order (add, then norm), so bf16 rounds the
        # same way; each add is fused into the norm after it.
        x, residual = self.input_layernorm.add_forward(h, residual)
        a = self.self_attn(x, cos, sin, meta)
        x, residual = self.post_attention_layernorm.add_forward(a, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        # Uninitialised: the checkpoint fills it (a random init costs the first call to
        # normal_, which imports torch._dynamo: 1.7 s of every start).
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden,
                                         _weight=torch.empty(cfg.vocab, cfg.hidden))
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.rotary = RotaryEmbedding(cfg.rope_parameters, cfg.head_dim, cfg.hf_config)
        self.lm_head: Linear | None = None  # tied: logits use embed_tokens.weight
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden, cfg.vocab, bias=False)
        # A tied head in another layout (a prepacked copy of the embedding, set by the runner)
        self.tied_head: Linear | None = None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_meta: AttentionMetadata
    ) -> torch.Tensor:
        # input_ids, positions: [T] -> final-normed hidden states [T, hidden]
        h = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary(positions, h.dtype)  # once per step, shared by all layers
        residual: torch.Tensor | None = None
        for layer in self.layers:
            h, residual = layer(h, residual, cos, sin, attn_meta)
        return self.norm.add_forward(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [S, hidden] (only the tokens that sample) -> [S, vocab] float32
        head = self.lm_head if self.lm_head is not None else self.tied_head
        if head is not None:
            return head(hidden).float()
        return torch.nn.functional.linear(hidden, self.embed_tokens.weight).float()

    def checkpoint_layout(self) -> dict[str, WeightSlot]:
        """Every tensor a Hugging Face checkpoint must hold -> where it goes in this module.

        A tied lm_head is absent (HF does not save it); the loader ignores one if present.
        """
        cfg = self.config
        out: dict[str, WeightSlot] = {
            "model.embed_tokens.weight": WeightSlot("embed_tokens.weight"),
            "model.norm.weight": WeightSlot("norm.weight"),
        }
        if self.lm_head is not None:
            out["lm_head.weight"] = WeightSlot("lm_head.weight")
        qkv_parts = (
            ("q_proj", 0, cfg.q_size),
            ("k_proj", cfg.q_size, cfg.kv_size),
            ("v_proj", cfg.q_size + cfg.kv_size, cfg.kv_size),
        )
        for i in range(cfg.layers):
            hf, ours = f"model.layers.{i}.", f"layers.{i}."
            out[hf + "input_layernorm.weight"] = WeightSlot(ours + "input_layernorm.weight")
            out[hf + "post_attention_layernorm.weight"] = WeightSlot(
                ours + "post_attention_layernorm.weight"
            )
            for name, start, rows in qkv_parts:
                out[f"{hf}self_attn.{name}.weight"] = WeightSlot(
                    ours + "self_attn.qkv_proj.weight", start, rows
                )
                if cfg.attention_bias:
                    out[f"{hf}self_attn.{name}.bias"] = WeightSlot(
                        ours + "self_attn.qkv_proj.bias", start, rows
                    )
            out[hf + "self_attn.o_proj.weight"] = WeightSlot(ours + "self_attn.o_proj.weight")
            if cfg.o_proj_bias:
                out[hf + "self_attn.o_proj.bias"] = WeightSlot(ours + "self_attn.o_proj.bias")
            if cfg.qk_norm:
                out[hf + "self_attn.q_norm.weight"] = WeightSlot(ours + "self_attn.q_norm.weight")
                out[hf + "self_attn.k_norm.weight"] = WeightSlot(ours + "self_attn.k_norm.weight")
            for kind in ("weight", "bias") if cfg.mlp_bias else ("weight",):
                fused = f"{ours}mlp.gate_up_proj.{kind}"
                out[f"{hf}mlp.gate_proj.{kind}"] = WeightSlot(fused, 0, cfg.intermediate)
                out[f"{hf}mlp.up_proj.{kind}"] = WeightSlot(
                    fused, cfg.intermediate, cfg.intermediate
                )
                out[f"{hf}mlp.down_proj.{kind}"] = WeightSlot(f"{ours}mlp.down_proj.{kind}")
        return out
