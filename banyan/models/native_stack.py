"""The Llama decoder stack as one native call for steps of a few tokens, or batched decodes
of a bf16 model (kernels/cpu_layer_stack.cpp).

At batch 1 the per-op path spends about as long in Python (~40 dispatches a layer, each
allocating its output and checking its inputs) as in its kernels. The stack calls the same
kernels in the same order with the same threads, so its hidden states equal the per-op path's
bit for bit (tested); it runs when every piece has a native kernel:

- float32 or bf16 activations on CPU, the K/V pool of that type or of int8 / fp8 codes
  (stored as kv_pool.quantize_rows stores them: cpu_stack_kv.h),
- every projection's method names its kernel (`LinearMethod.native`: the skinny float32,
  int8, int4 and GGUF-block methods; in bf16, the skinny bf16 method (on its pairs or its
  plain weight), or the quantized ones
  between a widened input and a rounded output, as their `apply` does; a library GEMM has
  none),
- the step has at most MAX_TOKENS tokens (a bf16 stack: SkinnyBf16Method.SKINNY_ROWS, and
  below quant.BF16_GEMM_MIN_TOKENS; one whose projections all have the bf16 GEMM, quantized
  or plain bf16 (its pairs), or a kernel of any step size (ANY_STEP_KINDS): GEMM_MAX_TOKENS,
  those kernels taking the long steps' projections as the per-op path's `apply` does, so
  batched decodes skip Python too) and the native
  attention plans (the row kernel's and the prefill kernel's) cover all of them.

Anything else returns None and the model's own forward runs. The structures hold raw pointers
into the model's weights and the pool; the stack keeps those tensors referenced, and checks
each step that no projection changed its method since (a test that dequantizes a model).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from ctypes import POINTER, c_double, c_int64, c_void_p

import numpy as np
import torch

from banyan.attention.base import AttentionMetadata
from banyan.attention.cpu_native import CpuNativeBackend, NativeMetadata
from banyan.kernels import native
from banyan.kernels.native import data_ptr
from banyan.layers.f32_linear import SkinnyF32Method
from banyan.layers.linear import Linear, LinearMethod, NativeLinear, SkinnyBf16Method
from banyan.layers.panels import unpack_bf16_pairs
from banyan.layers.quant import BF16_GEMM_KINDS, BF16_GEMM_MIN_TOKENS, DEQUANT_MIN_TOKENS
from banyan.mem import kv_pool
from banyan.mem.kv_pool import KVPool
from banyan.models import head_screen
from banyan.models.llama import LlamaForCausalLM

# The kernels' own switches: skinny float32 up to SKINNY_ROWS tokens, quantized GEMV-style
# kernels below DEQUANT_MIN_TOKENS; the stack runs only where every one of them applies.
MAX_TOKENS = min(SkinnyF32Method.SKINNY_ROWS, DEQUANT_MIN_TOKENS - 1)
# A bf16 stack whose projections all have the bf16 GEMM takes batched decodes too: one call a
# step instead of ~15 Python-dispatched ops a layer (prefill chunks past this keep the per-op
# path, where that overhead is a small share of the step; a dense layer's GEMM bound as well).
GEMM_MAX_TOKENS = SkinnyBf16Method.GEMM_ROWS
LINEAR_KINDS = {"skinny_f32": 0, "int8_rows": 1, "int4": 2, "int4_wide": 3, "int8_groups": 4,
                # with 8-bit activations (layers/int8_activations.py)
                "q8_int4": 5, "q8_int4_wide": 6, "q8_int8": 7, "q8_int5": 8,
                "skinny_bf16": 9, "pairs_bf16": 10,  # the dense kinds of a bf16 stack
                "q8_tiles": 11}  # int8 x int8 activations on int8 tiles (layers/int8_tiles.py)
# The stack's element types and the pools each runs over (code dtypes: None = as computed).
# Kinds whose own kernel takes a step of any size, in the per-op path as here (8-bit
# activations: `Int8ActivationMethod.apply` widens x and runs it at every size), so a bf16 stack
# of them takes batched decodes as one of bf16 GEMMs does (before, a 64-decode step of an int4
# model with --activation-quant int8 ran the per-op path: ~73 ms a step against bf16's ~67).
ANY_STEP_KINDS = frozenset(LINEAR_KINDS[k] for k in ("q8_int4", "q8_int4_wide", "q8_int8",
                                                     "q8_int5", "q8_tiles"))
ROPE_ROWS = 4096  # the RoPE tables' first size (positions); they double as positions need
ROPE_BLOCK = 512  # positions the tables are made in at a time (see _grow_rope)
# The pools the stack stores into and attends, in either element type (cpu_stack_kv.h:
# KvCodes): as they are, or codes with row scales, quantized as kv_pool.quantize_rows does.
KV_CODES = {None: 0, torch.int8: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}
# The projection kernels each element type's stack runs: the dense kernel of its own type, and
# every quantized one (float32 inside).
_QUANTIZED = frozenset(LINEAR_KINDS) - {"skinny_f32", "skinny_bf16", "pairs_bf16"}
STACK_KINDS = {torch.float32: _QUANTIZED | {"skinny_f32"},
               torch.bfloat16: _QUANTIZED | {"skinny_bf16", "pairs_bf16"}}


class StackLinear(ctypes.Structure):
    _fields_ = [("kind", c_int64), ("weight", c_void_p), ("scale", c_void_p),
                ("mins", c_void_p), ("bias", c_void_p), ("in_features", c_int64),
                ("out_features", c_int64), ("group", c_int64), ("gemm", c_int64),
                ("gemm_from", c_int64)]


class StackLayer(ctypes.Structure):
    _fields_ = [("input_norm", c_void_p), ("post_norm", c_void_p), ("q_norm", c_void_p),
                ("k_norm", c_void_p), ("qkv", StackLinear), ("o", StackLinear),
                ("gate_up", StackLinear), ("down", StackLinear), ("k_pool", c_void_p),
                ("v_pool", c_void_p), ("k_scale", c_void_p), ("v_scale", c_void_p)]


class KvStore(ctypes.Structure):
    _fields_ = [("codes", c_int64), ("shifts", c_void_p), ("n_shifts", c_int64)]


class StackModel(ctypes.Structure):
    _fields_ = [("layers", c_int64), ("hidden", c_int64), ("heads", c_int64),
                ("kv_heads", c_int64), ("head_dim", c_int64), ("intermediate", c_int64),
                ("eps", c_double), ("scale", c_double), ("layer", POINTER(StackLayer)),
                ("final_norm", c_void_p), ("embed", c_void_p), ("rope_cos", c_void_p),
                ("rope_sin", c_void_p), ("rope_rows", c_int64), ("head", StackLinear),
                ("screen_codes", c_void_p), ("screen_scale", c_void_p),
                ("screen_slack", c_void_p), ("screen_group", c_int64),
                ("screen_counts", c_void_p), ("kv", KvStore)]


class StackStep(ctypes.Structure):
    _fields_ = [("tokens", c_int64), ("input_ids", c_void_p), ("positions", c_void_p),
                ("out", c_void_p), ("slots", c_void_p), ("table", c_void_p),
                ("table_stride", c_int64), ("req_row", c_void_p), ("req_len", c_void_p),
                ("q_start", c_void_p), ("n_new", c_void_p), ("order", c_void_p),
                ("group_start", c_void_p), ("group_prefix", c_void_p), ("n_groups", c_int64),
                ("n_threads", c_int64), ("pf_req_row", c_void_p), ("pf_req_len", c_void_p),
                ("pf_q_start", c_void_p), ("pf_n_new", c_void_p), ("pf_reqs", c_int64),
                ("pf_tiles", c_int64), ("op_seconds", c_void_p), ("greedy_out", c_void_p),
                ("vocab", c_int64)]


# The kinds of op the stack times when asked (cpu_layer_stack.cpp: StackOp, in this order):
# what a profile of a step sees inside its one native call.
STACK_OPS = ("norms", "qkv", "rope", "kv_store", "attention", "o", "gate_up", "silu", "down",
             "head")


def _vector(t: torch.Tensor | None, n: int, dtype: torch.dtype) -> bool:
    return t is None or (t.dtype == dtype and t.shape == (n,) and t.is_contiguous())


class NativeLayerStack:
    """One call per step for the decoder layers of a loaded Llama-family model (see module)."""

    def __init__(self, model: LlamaForCausalLM, backend: CpuNativeBackend,
                 layers: list[StackLayer], keep: list[torch.Tensor],
                 methods: list[tuple[Linear, LinearMethod]]) -> None:
        cfg = model.config
        self.model, self.backend = model, backend
        self._keep = keep  # every tensor a pointer below refers to
        self.screen_counts: torch.Tensor | None = None  # (_add_screen)
        self._methods = methods
        self._generation = Linear.generation  # of the methods the pointers were taken from
        self._layers = (StackLayer * len(layers))(*layers)
        self._struct = StackModel(
            cfg.layers, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.intermediate,
            cfg.rms_eps, backend.scale, self._layers, model.norm.weight.data_ptr(),
            model.embed_tokens.weight.data_ptr())
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # (_grow_rope)
        self._grow_rope(min(ROPE_ROWS, backend.table.table.shape[1]))  # (positions < width)
        self._step = StackStep()
        self._op_seconds: torch.Tensor | None = None  # (time_ops)
        self._args = (ctypes.byref(self._struct), ctypes.byref(self._step))  # made once
        lib = native.load()
        assert lib is not None
        bf16 = model.embed_tokens.weight.dtype == torch.bfloat16
        self._call = getattr(lib, "banyan_layer_stack_" + ("bf16" if bf16 else "f32"))
        # the most tokens a step may have: the projections' kernels' own bound, or where every
        # projection has the bf16 GEMM for long steps (or a kernel of any size), GEMM_MAX_TOKENS
        gemm = all(p.gemm >= 0 or p.kind in ANY_STEP_KINDS for layer in layers
                   for p in (layer.qkv, layer.o, layer.gate_up, layer.down))
        self.max_tokens = (GEMM_MAX_TOKENS if bf16 and gemm else
                           min(SkinnyBf16Method.SKINNY_ROWS, BF16_GEMM_MIN_TOKENS - 1) if bf16
                           else MAX_TOKENS)

    def _grow_rope(self, rows: int) -> None:
        """The cos / sin tables for positions 0 .. rows - 1 (at least), from the model's own
        rotary embedding, ROPE_BLOCK positions a call: torch's element-wise ops run whole
        vectors over each (a step's few positions get the vector code too, where a long
        tensor split between threads may end a part on the scalar code), so a table row is bit
        for bit what the embedding gives that position in a step (tested)."""
        rows = -(-max(rows, 2 * self._struct.rope_rows) // ROPE_BLOCK) * ROPE_BLOCK
        dtype = self.model.embed_tokens.weight.dtype
        parts = [self.model.rotary.forward(torch.arange(p, p + ROPE_BLOCK), dtype)
                 for p in range(0, rows, ROPE_BLOCK)]
        self._rope = cos, sin = (torch.cat([c for c, _ in parts]),
                                 torch.cat([s for _, s in parts]))
        self._struct.rope_cos, self._struct.rope_sin = cos.data_ptr(), sin.data_ptr()
        self._struct.rope_rows = rows

    def time_ops(self, on: bool = True) -> None:
        """From the next call on, add each kind of op's seconds up (from zero), or stop."""
        self._op_seconds = torch.zeros(len(STACK_OPS), dtype=torch.float64) if on else None
        self._step.op_seconds = None if self._op_seconds is None else \
            self._op_seconds.data_ptr()

    def op_seconds(self) -> dict[str, float]:
        """Seconds each kind of op (STACK_OPS) took in the calls since time_ops(); {} when
        not timing."""
        if self._op_seconds is None:
            return {}
        return dict(zip(STACK_OPS, self._op_seconds.tolist(), strict=True))

    @classmethod
    def build(cls, model: torch.nn.Module, pool: KVPool,
              backend: object) -> NativeLayerStack | None:
        """The stack for this model, pool and attention backend, or None where a piece has no
        native kernel (then the model's forward runs every step)."""
        if not (isinstance(model, LlamaForCausalLM) and isinstance(backend, CpuNativeBackend)
                and native.load() is not None and pool.device.type == "cpu"):
            return None
        dtype = model.embed_tokens.weight.dtype
        if pool.dtype != dtype or dtype not in STACK_KINDS or pool.code_dtype not in KV_CODES:
            return None
        cfg = model.config
        keep: list[torch.Tensor] = []
        methods: list[tuple[Linear, LinearMethod]] = []

        def linear(layer: Linear) -> StackLinear | None:
            spec: NativeLinear | None = layer.method.native(layer)
            if spec is None or spec.kind not in STACK_KINDS[dtype]:
                return None
            bias = spec.bias if spec.bias is not None else layer.bias
            bias_dtype = torch.bfloat16 if spec.kind == "skinny_bf16" else torch.float32
            if not _vector(bias, layer.out_features, bias_dtype):
                return None
            methods.append((layer, layer.method))
            parts = [t for t in (spec.weight, spec.scale, spec.mins, bias) if t is not None]
            if not all(t.is_contiguous() for t in parts):
                return None
            keep.extend(parts)
            # a bf16 stack's long steps: the bf16 GEMM where the per-op path takes it (not
            # where the method keeps its short kernel at every size: batch_invariant)
            gemm, gemm_from = -1, 0
            if dtype == torch.bfloat16 and spec.kind in BF16_GEMM_KINDS and \
                    native.bf16_gemm_applies(layer.in_features) and \
                    not layer.method.batch_invariant:
                gemm, gemm_from = BF16_GEMM_KINDS[spec.kind], BF16_GEMM_MIN_TOKENS
            elif spec.kind == "pairs_bf16":  # every step, as SkinnyBf16Method.apply does
                gemm, gemm_from = native.PAIRS_BF16_KIND, 1
            return StackLinear(LINEAR_KINDS[spec.kind], data_ptr(spec.weight), data_ptr(spec.scale),
                               data_ptr(spec.mins), data_ptr(bias), layer.in_features,
                               layer.out_features, spec.group, gemm, gemm_from)

        layers = []
        for i, block in enumerate(model.layers):
            attn = block.self_attn
            norms = (block.input_layernorm, block.post_attention_layernorm, attn.q_norm,
                     attn.k_norm)
            for norm, width in zip(norms, (cfg.hidden, cfg.hidden, cfg.head_dim, cfg.head_dim)):
                if norm is not None and (norm.eps != cfg.rms_eps or
                                         not _vector(norm.weight, width, dtype)):
                    return None
            projections = [linear(p) for p in (attn.qkv_proj, attn.o_proj,
                                               block.mlp.gate_up_proj, block.mlp.down_proj)]
            if any(p is None for p in projections):
                return None
            kv = pool.layer(i)
            keep += [t for t in (kv.k, kv.v, kv.k_scale, kv.v_scale) if t is not None]
            keep += [n.weight for n in norms if n is not None]
            layers.append(StackLayer(
                *(data_ptr(n.weight) if n is not None else None for n in norms), *projections,
                kv.k.data_ptr(), kv.v.data_ptr(), data_ptr(kv.k_scale), data_ptr(kv.v_scale)))
        if not _vector(model.norm.weight, cfg.hidden, dtype) or \
                not model.embed_tokens.weight.is_contiguous():
            return None
        keep += [model.norm.weight, model.embed_tokens.weight]
        stack = cls(model, backend, layers, keep, methods)
        shifts = kv_pool.fp8_shifts(pool.device)  # (the per-op path's, whatever they are)
        stack._keep.append(shifts)
        stack._struct.kv = KvStore(KV_CODES[pool.code_dtype], shifts.data_ptr(), shifts.numel())
        head = model.lm_head if model.lm_head is not None else model.tied_head
        spec = linear(head) if head is not None else None  # (its method checked as theirs)
        if spec is not None:  # else greedy() declines: the model's own head runs
            stack._struct.head = spec
            step_bytes = sum(m.weight_bytes() for m in model.modules() if isinstance(m, Linear))
            if spec.kind == LINEAR_KINDS["pairs_bf16"] and not spec.bias and \
                    head_screen.wanted(head.weight_bytes(), step_bytes):
                stack._add_screen(head)
        return stack

    def _add_screen(self, head: Linear) -> None:
        """One-token greedy steps through the head's int8 copy (models/head_screen.py)."""
        # (the pairs of PairsBf16Method or SkinnyBf16Method, whichever holds the head)
        screen = head_screen.make_head_screen(unpack_bf16_pairs(head.pairs, head.out_features))
        if screen is None:
            return
        self.screen_counts = torch.zeros(2, dtype=torch.int64)  # steps screened, fallen back
        self._keep += [screen.codes, screen.scale, screen.slack, self.screen_counts]
        self._struct.screen_codes, self._struct.screen_scale = screen.codes.data_ptr(), \
            screen.scale.data_ptr()
        self._struct.screen_slack, self._struct.screen_group = screen.slack.data_ptr(), \
            head_screen.GROUP
        self._struct.screen_counts = self.screen_counts.data_ptr()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor | None:
        """The model's forward (final-normed hidden states [T, hidden]) in one native call, or
        None when this step is not one the stack runs."""
        return self._run(input_ids, positions, meta, None, 0)

    @property
    def picks_greedy(self) -> bool:
        """Whether greedy (and greedy_burst) can pick tokens: the head has a kernel here."""
        return bool(self._struct.head.weight)

    def greedy(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
               vocab: int) -> torch.Tensor | None:
        """Each token's greedy next token (int64 [T]: the LM head over its final hidden state,
        the first of its largest logits among the first `vocab`, as the sampler's argmax picks
        it) in the same native call, or None where the stack does not run the step or has no
        kernel for the head. The head's kernel and bits are the per-op path's."""
        if not self.picks_greedy:
            return None
        tokens = torch.empty(input_ids.shape[0], dtype=torch.int64)
        vocab = min(vocab, self._struct.head.out_features)
        return tokens if self._run(input_ids, positions, meta, tokens, vocab) is not None \
            else None

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
             greedy_out: torch.Tensor | None, vocab: int) -> torch.Tensor | None:
        T = input_ids.shape[0]
        if T > self.max_tokens or not isinstance(meta, NativeMetadata) or \
                meta.backend is not self.backend:
            return None
        plan, long = meta.native, meta.prefill
        if (plan.num_tokens if plan else 0) + (long.num_tokens if long else 0) != T:
            return None  # some request on SDPA (the prefill kernel switched off)
        if Linear.generation != self._generation:  # some Linear's method was set since
            if any(layer.method is not method for layer, method in self._methods):
                return None  # one of these projections was converted after the stack was built
            self._generation = Linear.generation  # (another model's)
        # the stream (the tokens' embedding rows) and their cos / sin rows are gathered inside
        out = torch.empty(T, self._struct.hidden, dtype=self.model.embed_tokens.weight.dtype)
        table = self.backend.table.table
        s = self._step
        s.tokens, s.input_ids, s.positions, s.out = T, input_ids.data_ptr(), \
            positions.data_ptr(), out.data_ptr()
        s.slots, s.table, s.table_stride = meta.out_slots.data_ptr(), table.data_ptr(), \
            table.shape[1]
        if plan is None:
            s.n_groups = 0
        else:
            s.req_row, s.req_len, s.q_start = plan.req_row.data_ptr(), \
                plan.req_len.data_ptr(), plan.q_start.data_ptr()
            s.n_new, s.order, s.group_start = plan.n_new.data_ptr(), plan.order.data_ptr(), \
                plan.group_start.data_ptr()
            s.group_prefix, s.n_groups = plan.group_prefix.data_ptr(), \
                plan.group_prefix.shape[0]
        if long is None:
            s.pf_reqs = 0
        else:
            s.pf_req_row, s.pf_req_len = long.req_row.data_ptr(), long.req_len.data_ptr()
            s.pf_q_start, s.pf_n_new = long.q_start.data_ptr(), long.n_new.data_ptr()
            s.pf_reqs = long.n_new.shape[0]
            s.pf_tiles = self.backend.tiles  # the per-op path's products (bf16 only)
        s.n_threads = torch.get_num_threads()
        s.greedy_out, s.vocab = data_ptr(greedy_out), vocab
        self._invoke()
        return out

    def _invoke(self) -> None:
        """The native call over the step as set in self._step."""
        with native.kernel_range("banyan::layer_stack"):
            rows = self._call(*self._args)
            if rows:  # a position past the RoPE tables: nothing was done
                self._grow_rope(rows)
                self._call(*self._args)

    def greedy_burst(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     meta: AttentionMetadata, vocab: int, later_slots: torch.Tensor,
                     stops: frozenset[int]) -> list[list[int]] | None:
        """`greedy` over a burst of decode steps (run_burst), stopping after a step that
        picked one of `stops`. -> each request's tokens over the k steps run (k each), or None
        where greedy would decline the first."""
        if not self.picks_greedy:
            return None
        def no_stop(step: int, row: np.ndarray, hidden: torch.Tensor) -> bool:
            return not stops or stops.isdisjoint(row.tolist())

        vocab = min(vocab, self._struct.head.out_features)
        picked = self.run_burst(input_ids, positions, meta, later_slots, vocab, no_stop)
        return None if picked is None else picked.T.tolist()

    def run_burst(self, input_ids: torch.Tensor, positions: torch.Tensor,
                  meta: AttentionMetadata, later_slots: torch.Tensor, vocab: int,
                  after: Callable[[int, np.ndarray, torch.Tensor], bool]) -> np.ndarray | None:
        """Decode steps back to back (ForwardBatch.decode_steps), up to later_slots.shape[0]
        + 1: step j's inputs are step j - 1's picks one position on, their K/V to
        later_slots[j - 1] ([steps - 1, T] int64, already in the table). With vocab > 0 a
        step's greedy picks come from its native call (as in `greedy`); with 0 `after` writes
        them from the step's final-normed hidden states [T, hidden] (a draft model's guesses).
        after(j, picks of step j [T], hidden) says whether step j + 1 runs. Each step is the
        call `greedy` or `forward` makes for a step of these decodes (the same bits); between
        them only the pointers that move are set. Arrays by numpy and pointers by arithmetic:
        a torch op costs ~10-20 us here (the weights' stream evicted its code and data), as
        much as a burst saves a step at bf16. -> int64 [k, T], the picks of the k steps run,
        or None where the stack does not run the first."""
        steps, T = later_slots.shape[0] + 1, input_ids.shape[0]
        plan = meta.native if isinstance(meta, NativeMetadata) else None
        if plan is None or plan.num_tokens != T:
            return None
        assert later_slots.dtype == torch.int64 and later_slots.is_contiguous()
        # (made before the first step: after it, its weight stream has evicted numpy as well)
        tokens = torch.empty(steps, T, dtype=torch.int64)
        picked = tokens.numpy()
        ahead = np.arange(steps, dtype=np.int64).reshape(steps, 1)
        positions_at = positions.numpy() + ahead  # [steps, T], as req_len_at
        req_len_at = plan.req_len.numpy() + ahead
        row = T * 8  # bytes of one step's row of each int64 [steps, T] array
        token_at, position_at = picked.ctypes.data, positions_at.ctypes.data
        slot_at, length_at = later_slots.data_ptr() - row, req_len_at.ctypes.data
        hidden = self._run(input_ids, positions, meta, tokens[0] if vocab else None, vocab)
        if hidden is None:
            return None
        s = self._step
        done = 1
        while after(done - 1, picked[done - 1], hidden) and done < steps:
            offset = done * row
            s.input_ids = token_at + offset - row
            s.greedy_out = token_at + offset if vocab else 0
            s.positions, s.slots = position_at + offset, slot_at + offset
            s.req_len = length_at + offset
            self._invoke()
            done += 1
        return picked[:done]
