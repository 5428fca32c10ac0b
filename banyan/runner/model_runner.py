"""ModelRunner: owns the model, the KV pool, the request-to-token table and the attention backend,
and turns one `ForwardBatch` (plain lists from the scheduler) into logits.

Per step: validate the batch (cheap C-speed min/max over the lists, so a scheduler bug is a
ValueError rather than a CUDA device assert), build the input tensors once, write the table,
let the backend plan, run the model, and compute logits only at the last new token of each
request that samples. Sampling is not done here (see banyan/sampling).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from banyan.attention.registry import create_backend
from banyan.batch import ForwardBatch, TokenLogprobs
from banyan.host_tensors import int64_tensor, to_device
from banyan.layers.gguf_linear import gguf_repacked_tensors
from banyan.layers.int8_activations import check_activation_quant, enable_int8_activations
from banyan.layers.int8_tiles import enable_int8_tiles
from banyan.layers.quant import quantization_runs
from banyan.mem.kv_pool import KVPool, kv_code_dtype, kv_row_scales, num_slots_for_bytes
from banyan.mem.req_table import ReqToTokenTable
from banyan.models.config import ModelConfig
from banyan.models.loader import load_model
from banyan.models.native_stack import NativeLayerStack
from banyan.runner.batch_checks import BatchChecks
from banyan.runner.batch_invariant import make_batch_invariant
from banyan.runner.cuda_graph import DecodeGraphs, GraphApi
from banyan.runner.cpu_dtype import compute_dtype
from banyan.runner.device import available_memory, resolve_device
from banyan.runner.host_memory import keep_freed_memory
from banyan.runner.kv_sizing import (
    CudaMemoryProbe,
    KVSizing,
    MemoryProbe,
    measure_peak,
    size_by_warmup,
    warmup_batch,
)
from banyan.runner.linear_setup import convert_model_linears
from banyan.runner.mixed_step import split_mixed_step
from banyan.runner.prompt_logprobs import compute_prompt_logprobs, prompt_logprob_inputs
from banyan.runner.step_inputs import (BurstInputs, DeferredInputs, LongPart, StepInputs,
                                       merge_parts)

if TYPE_CHECKING:
    from banyan.args import EngineArgs

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model_path: str | Path,
        dtype: str | torch.dtype | None = "auto",
        device: str | torch.device = "cpu",
        kv_cache_bytes: int | None = None,
        num_slots: int | None = None,
        max_rows: int = 128,
        max_context: int | None = None,
        mem_fraction: float | None = None,
        show_progress: bool = True,
        attention_backend: str = "auto",
        quantization: str = "none",
        linear_kernel: str = "auto",
        kv_cache_dtype: str = "auto",
        activation_quant: str = "none",
        gguf_file: Path | None = None,
        cuda_graphs: bool = True,
        warmup_tokens: int | None = None,
        warmup_chunk: int | None = None,
        memory_probe: MemoryProbe | None = None,
        batch_invariant: bool = False,
    ) -> None:
        """KV cache size, first given wins: num_slots (padding slot included), kv_cache_bytes,
        mem_fraction of the memory available after the weights are loaded (that last one capped
        at max_rows * max_context + 1 slots). On CUDA with warmup_tokens given, mem_fraction
        applies to what the largest step leaves: a warm-up step of warmup_tokens prompt tokens
        (chunks of at most warmup_chunk per request, decodes in the other rows) is run first
        and its activation peak set aside (runner/kv_sizing.py); memory_probe: the memory reads
        that uses (default: CUDA's; a probe given on CPU runs the warm-up there, for tests).
        max_context: longest sequence a table row holds (default max_position_embeddings).
        quantization: none | int8 | int4 weight-only linears (layers/quant.py), or gguf: the
        linears of `gguf_file` (the file model_path was converted from) computed from its own
        blocks (layers/gguf_linear.py); auto: gguf where that can run, else none.
        linear_kernel: auto | torch | native, for unquantized linears (EngineArgs.linear_kernel).
        kv_cache_dtype: auto | int8 | fp8_e4m3 | fp8_e5m2 | fp8 storage of the KV cache
            (mem/kv_pool.py).
        activation_quant: none | int8 (layers/int8_activations.py) | int8_tiles
        (layers/int8_tiles.py). cuda_graphs: decode steps
        replayed from CUDA graphs (runner/cuda_graph.py) where the backend can be captured.
        batch_invariant: each token's bits independent of its step (runner/batch_invariant.py)."""
        if num_slots is None and kv_cache_bytes is None and mem_fraction is None:
            raise ValueError("give num_slots, kv_cache_bytes or mem_fraction to size the KV cache")
        self.device = resolve_device(device)
        # mixed steps as two forwards (mixed_step.py), needless where every kernel is invariant
        self.split_mixed_steps = not batch_invariant
        if self.device.type == "cpu":  # activations on the heap, not fresh pages per step
            keep_freed_memory()
        code_dtype, row_scales = kv_code_dtype(kv_cache_dtype), kv_row_scales(kv_cache_dtype)
        self.model_config = ModelConfig.from_pretrained(model_path)
        cfg = self.model_config
        quantized = quantization != "none" and (quantization != "auto" or gguf_file is not None)
        self.dtype = compute_dtype(dtype, cfg.torch_dtype, self.device, model_path, quantized)
        if quantization == "auto":  # a GGUF model computes from its blocks where it can
            runnable = gguf_file is not None and quantization_runs("gguf", self.device, self.dtype)
            quantization = "gguf" if runnable else "none"
        check_activation_quant(activation_quant, quantization, self.device)  # before loading
        # The linears the file's blocks replace are not read from its dequantized conversion
        # (0.25 s of the default model's start; a 7B file's float32 copy is 28 GB).
        gguf_path = gguf_file if quantization == "gguf" else None
        self.model = load_model(
            model_path, dtype=self.dtype, device=self.device, show_progress=show_progress,
            config=cfg, not_read=(None if gguf_path is None else
                                  lambda model: gguf_repacked_tensors(model, gguf_path)))
        self.quantization = quantization
        convert_model_linears(self.model, self.device, self.dtype, quantization, linear_kernel,
                              gguf_file, batch_invariant)
        self.activation_quant, self.batch_invariant = activation_quant, batch_invariant
        if activation_quant == "int8":
            enable_int8_activations(self.model)
        elif activation_quant == "int8_tiles":
            enable_int8_tiles(self.model)
        self.max_rows = max_rows
        self.max_context = max_context or cfg.max_position_embeddings
        self.checks = BatchChecks(max_rows, self.max_context)
        # before the pool: the warm-up step writes it, and its size is then no longer free
        self.table = ReqToTokenTable(self.max_rows, self.max_context, self.device)
        self.kv_sizing: KVSizing | None = None  # the warm-up's figures, when it sized the pool
        self.stack: NativeLayerStack | None = None
        self.graphs: DecodeGraphs | None = None
        probe = memory_probe  # (a CPU step's peak is not measured: no warm-up there)
        if probe is None and self.device.type == "cuda":
            probe = CudaMemoryProbe(self.device)
        if num_slots is None and kv_cache_bytes is not None:
            num_slots = num_slots_for_bytes(
                kv_cache_bytes, cfg.layers, cfg.kv_heads, cfg.head_dim, self.dtype, code_dtype,
                row_scales)
        elif num_slots is None:
            assert mem_fraction is not None
            if warmup_tokens is not None and probe is not None:
                chunk = warmup_chunk or warmup_tokens
                self.kv_sizing = size_by_warmup(probe, mem_fraction, warmup_tokens, lambda: (
                    self._warmup_peak(probe, warmup_tokens, chunk, attention_backend, code_dtype,
                                      row_scales)))
                budget = self.kv_sizing.budget
            else:
                budget = int(available_memory(self.device) * mem_fraction)
            num_slots = num_slots_for_bytes(
                budget, cfg.layers, cfg.kv_heads, cfg.head_dim, self.dtype, code_dtype, row_scales
            )
            # The implicit default is bounded by what running rows can reference at once, so a
            # CPU host does not zero a quarter of its RAM for a small model. An explicit size
            # is honoured as given (a prefix cache can use slots beyond the rows).
            useful = self.max_rows * self.max_context + 1
            if num_slots > useful:
                logger.info(
                    "KV cache: %d slots capped to %d (max_rows x max_context + 1)",
                    num_slots,
                    useful,
                )
                num_slots = useful
        self.pool = KVPool(cfg.layers, num_slots, cfg.kv_heads, cfg.head_dim, self.dtype,
                           self.device, code_dtype, row_scales)
        self.backend = create_backend(attention_backend, self.pool, self.table)
        if batch_invariant:  # (before the stack reads its projections' kernels)
            make_batch_invariant(self.model, self.backend)
        # small steps' decoder layers in one native call where every piece has a kernel
        self.stack = NativeLayerStack.build(self.model, self.pool, self.backend)
        if cuda_graphs and self.device.type == "cuda" and self.backend.supports_graphs:
            self.enable_graphs()
        self.timings: dict[str, float] = {"prepare": 0.0, "forward": 0.0}
        logger.info(
            "KV cache: %d slots (%s, %.1f MiB, %d bytes per token), table %d rows x %d "
            "positions; attention: %s%s",
            num_slots,
            kv_cache_dtype if code_dtype is not None else str(self.dtype).removeprefix("torch."),
            self.pool.total_bytes / 2**20,
            self.pool.bytes_per_slot,
            self.max_rows,
            self.max_context,
            self.backend.name,
            "; small steps: one native call" if self.stack is not None else "",
        )

    def _warmup_peak(self, probe: MemoryProbe, tokens: int, chunk: int, attention_backend: str,
                     code_dtype: torch.dtype | None, row_scales: bool) -> int:
        """Run the largest step over a temporary pool just big enough for it -> the step's
        activation peak in bytes. The pool, its backend and the step's tensors are gone when
        this returns; the table keeps stale entries, which no step reads unmasked."""
        cfg = self.model_config
        batch = warmup_batch(tokens, chunk, self.max_rows, self.max_context, cfg.vocab)
        # prepare/compute read these attributes: the warm-up is an ordinary step (the native
        # stack and the decode graphs are built after it, over the real pool)
        self.pool = KVPool(cfg.layers, batch.num_tokens + 1, cfg.kv_heads, cfg.head_dim,
                           self.dtype, self.device, code_dtype, row_scales)
        self.backend = create_backend(attention_backend, self.pool, self.table)
        try:
            return measure_peak(probe, lambda: self.compute(self.prepare(batch)))
        except torch.OutOfMemoryError as exc:
            raise RuntimeError(
                f"KV cache: the warm-up step of {batch.num_tokens} tokens ({tokens} prompt "
                f"tokens in chunks of {chunk}, {batch.batch_size} rows) does not fit in the "
                "memory left after the weights; lower --max-prefill-tokens / "
                "--chunked-prefill-size or --max-running-requests"
            ) from exc
        finally:
            del self.pool, self.backend
            self.checks.checked_rows = []

    @classmethod
    def from_engine_args(
        cls, args: EngineArgs, max_rows: int | None = None, model_path: str | Path | None = None
    ) -> ModelRunner:
        """The runner EngineArgs describe. max_rows defaults to max_running_requests; the
        model to args.model as resolve_model_dir reads it (a GGUF file, the default model)."""
        from banyan.args import parse_bytes
        from banyan.model_files import gguf_source, resolve_model_dir

        path = model_path or resolve_model_dir(args.model, show_progress=not args.disable_tqdm)
        kv_bytes = parse_bytes(args.kv_cache_memory) if args.kv_cache_memory is not None else None
        return cls(
            path,
            dtype=args.dtype,
            device=args.device,
            kv_cache_bytes=kv_bytes,
            max_rows=max_rows or args.max_running_requests,
            max_context=args.max_model_len,
            mem_fraction=args.mem_fraction,
            show_progress=not args.disable_tqdm,
            attention_backend=args.attention_backend,
            quantization=args.quantization,
            linear_kernel=args.linear_kernel,
            kv_cache_dtype=args.kv_cache_dtype,
            activation_quant=args.activation_quant,
            gguf_file=gguf_source(args.model) if args.quantization in ("auto", "gguf") else None,
            cuda_graphs=not args.disable_cuda_graph,
            # the largest step the scheduler builds (BudgetConfig): its activations are set
            # aside before --mem-fraction sizes the KV cache
            warmup_tokens=args.max_prefill_tokens,
            warmup_chunk=args.chunked_prefill_size,
            batch_invariant=args.enable_deterministic_inference,
        )

    # ------------------------------------------------------------------ public surface

    @property
    def num_slots(self) -> int:
        return self.pool.num_slots

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab

    @property
    def bytes_per_token(self) -> int:
        return self.pool.bytes_per_slot

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Prepare and run one step -> logits [logit rows, vocab] float32 (see `prepare`)."""
        t0 = time.perf_counter()
        inputs = self.prepare(batch)
        t1 = time.perf_counter()
        logits = self.compute_logits(inputs)
        self.timings = {"prepare": t1 - t0, "forward": time.perf_counter() - t1}
        return logits

    def enable_graphs(self, api: GraphApi | None = None) -> None:
        """Capture the decode graphs now (api: torch.cuda's, or a test's fake device)."""
        self.graphs = DecodeGraphs(self.model.__call__, self.backend, self.max_rows,
                                   self.device, api)
        self.graphs.capture()
        logger.info("CUDA graphs captured for decode batches of %s", self.graphs.captured)

    def compute_logits(self, inputs: StepInputs) -> torch.Tensor:
        """The model over a prepared step -> logits at `inputs.logit_tokens`, float32.
        Host-side time: on CUDA this is launch time unless the caller synchronizes."""
        return self.compute(inputs)[0]

    def compute(self, inputs: StepInputs) -> tuple[torch.Tensor, list[list[TokenLogprobs]]]:
        """The model over a prepared step -> (logits at `inputs.logit_tokens`, float32; the
        prompt logprobs of each ForwardBatch.prompt_logprobs span, empty when none)."""
        if inputs.long_part is not None:  # each part whole, the LM head too
            return merge_parts([self._logits(p) for p in inputs.parts()], inputs.long_part)
        return self._logits(inputs)

    def greedy_tokens(self, inputs: StepInputs, vocab: int) -> list[int] | None:
        """Each logit row's argmax over the first `vocab` logits, for a step of plain greedy
        rows, in the layer stack's one call (head and argmax included: the same bits and
        tokens as compute + the sampler's argmax), or None where that does not apply (then
        compute and sample)."""
        if self.stack is None or not self._stack_picks(inputs):
            return None
        with torch.inference_mode():
            tokens = self.stack.greedy(inputs.input_ids, inputs.positions, inputs.attn_meta,
                                       vocab)
        return None if tokens is None else tokens.tolist()

    def greedy_burst(self, inputs: StepInputs, vocab: int) -> list[list[int]] | None:
        """greedy_tokens over a burst's decode steps (inputs.burst): each request's tokens,
        the same count for all, each step the call greedy_tokens makes for it (the same bits);
        None where the stack does not take it (then one step is all the runner computes)."""
        if self.stack is None or inputs.burst is None or not self._stack_picks(inputs):
            return None
        burst = inputs.burst
        with torch.inference_mode():
            return self.stack.greedy_burst(inputs.input_ids, inputs.positions, inputs.attn_meta,
                                           vocab, burst.later_slots, burst.stops)

    def hidden_burst(self, inputs: StepInputs,
                     after: Callable[[int, np.ndarray, torch.Tensor], bool]) -> int | None:
        """A burst's decode steps (inputs.burst) with each step's inputs picked by `after` from
        the hidden states of the step before (NativeLayerStack.run_burst: a draft model's
        guesses) -> the steps run, or None where the layer stack does not run them."""
        if self.stack is None or inputs.burst is None or inputs.long_part is not None:
            return None
        with torch.inference_mode():
            picked = self.stack.run_burst(inputs.input_ids, inputs.positions, inputs.attn_meta,
                                          inputs.burst.later_slots, 0, after)
        return None if picked is None else len(picked)

    @staticmethod
    def _stack_picks(inputs: StepInputs) -> bool:
        """Whether the layer stack may pick this step's greedy tokens itself (if it runs it)."""
        return inputs.every_token and inputs.long_part is None and inputs.prompt is None

    def _logits(self, inputs: StepInputs) -> tuple[torch.Tensor, list[list[TokenLogprobs]]]:
        """compute for one forward (a step, or a part of a mixed one)."""
        picked, prompt = self._hidden(inputs)
        if picked is None:
            return torch.empty((0, self.vocab_size), dtype=torch.float32,
                               device=self.device), prompt
        with torch.inference_mode():
            return self.model.compute_logits(picked), prompt

    def compute_hidden(self, inputs: StepInputs
                       ) -> tuple[torch.Tensor | None, list[list[TokenLogprobs]]]:
        """`compute` short of the LM head: the final-normed hidden states at
        `inputs.logit_tokens` (None when none) and the prompt logprobs (a draft picks its
        guesses from the hidden states itself: spec/draft_head.py)."""
        if inputs.long_part is not None:
            return merge_parts([self._hidden(p) for p in inputs.parts()], inputs.long_part)
        return self._hidden(inputs)

    def _hidden(self, inputs: StepInputs
                ) -> tuple[torch.Tensor | None, list[list[TokenLogprobs]]]:
        """compute_hidden for one forward."""
        with torch.inference_mode():
            hidden = None
            if inputs.graph is not None and self.graphs is not None:
                batch, out_slots = inputs.graph
                hidden = self.graphs.run(batch, inputs.input_ids, inputs.positions, out_slots)
            if hidden is None and self.stack is not None:
                hidden = self.stack.forward(inputs.input_ids, inputs.positions,
                                            inputs.attn_meta)
            if hidden is None:  # [T, hidden]
                hidden = self.model(inputs.input_ids, inputs.positions, inputs.attn_meta)
            prompt = ([] if inputs.prompt is None else
                      compute_prompt_logprobs(hidden, self.model.compute_logits, inputs.prompt))
            if inputs.logit_tokens is None:
                return None, prompt
            picked = hidden if inputs.every_token else hidden.index_select(0, inputs.logit_tokens)
            return picked, prompt

    def prepare(self, batch: ForwardBatch) -> StepInputs:
        """Validate the batch, build its tensors, write the table, plan attention; a mixed
        step (runner/mixed_step.py) as its two parts.

        Logit rows, in order: per sampling request (batch.sample_indices order), its last new
        token, or with k proposals its last k + 1 new tokens (the logits that check each
        proposal, then the one after the last)."""
        self.validate(batch)
        split = split_mixed_step(batch) if self.split_mixed_steps else None
        if split is not None:
            short, long = self._prepare(split.short), self._prepare(split.long)
            order = to_device(int64_tensor(split.logit_order), self.device)
            short.long_part = LongPart(long, order, split.prompt_order)
            return short
        return self._prepare(batch)

    def _prepare(self, batch: ForwardBatch) -> StepInputs:
        """prepare for one forward (validated)."""
        dev = self.device
        # Every extend is >= 1 and they sum to T (validated): T == B means all are decodes,
        # whose flat index, position and row come straight from the lists.
        decode_only = batch.num_tokens == batch.batch_size
        starts: torch.Tensor | None = None  # flat index of each request's first new token
        if decode_only:
            positions = int64_tensor(batch.prefix_lens)
            token_rows = int64_tensor(batch.rows)
        else:
            ext = int64_tensor(batch.extend_lens)
            starts = torch.cumsum(ext, 0) - ext
            pre = int64_tensor(batch.prefix_lens)
            # position of flat token t of request i = prefix_i + (t - start_i)
            positions = torch.repeat_interleave(pre - starts, ext) + torch.arange(batch.num_tokens)
            token_rows = torch.repeat_interleave(int64_tensor(batch.rows), ext)
        logit_tokens = None
        if batch.sample_indices:
            index = int64_tensor(batch.sample_indices)
            # a decode's last new token is its only one: flat index == batch index
            picked = index if starts is None else (starts + ext - 1)[index]
            if any(batch.proposed):
                counts = int64_tensor([len(p) + 1 for p in batch.proposed])
                first = torch.cumsum(counts, 0) - counts
                offsets = torch.arange(int(counts.sum())) - torch.repeat_interleave(first, counts)
                picked = torch.repeat_interleave(picked - counts + 1, counts) + offsets
            logit_tokens = to_device(picked, dev)
        deferred = None
        if batch.deferred_inputs:
            flat = int64_tensor(batch.deferred_inputs)
            deferred = DeferredInputs(to_device(flat, dev), to_device(token_rows[flat], dev))
        input_ids = to_device(int64_tensor(batch.input_ids), dev)
        out_slots = to_device(int64_tensor(batch.out_slots), dev)
        positions = to_device(positions, dev)
        token_rows = to_device(token_rows, dev)
        self.table.write_batch(batch, token_rows, positions, out_slots)
        burst = None
        if batch.decode_steps > 1:  # the later inputs' slots in the table now, as the first's
            later = to_device(int64_tensor(batch.later_slots), dev).view(batch.decode_steps - 1,
                                                                        batch.batch_size)
            self.table.write_ahead(token_rows, positions, later)
            burst = BurstInputs(later, batch.burst_stops)
        meta = self.backend.plan(batch, out_slots)
        prompt = None
        if batch.prompt_logprobs:
            first = torch.arange(batch.batch_size) if starts is None else starts
            prompt = prompt_logprob_inputs(batch, first.tolist(), dev)
        graph = ((batch, out_slots) if self.graphs is not None and decode_only
                 and not batch.prompt_logprobs else None)
        # every token's logits, in order: decodes, and speculative checks whose k guesses
        # are all of their k + 1 new tokens but one
        every = batch.sample_indices == list(range(batch.batch_size)) and (  # (non-empty)
            all(n == len(p) + 1 for n, p in zip(batch.extend_lens, batch.proposed, strict=True))
            if any(batch.proposed) else decode_only)
        return StepInputs(input_ids, positions, logit_tokens, meta, deferred, prompt, graph, every,
                          burst=burst)

    def validate(self, batch: ForwardBatch) -> None:
        """ValueError on a batch that would index out of the pool, table or vocabulary."""
        self.checks.check(batch, self.num_slots, self.vocab_size)
