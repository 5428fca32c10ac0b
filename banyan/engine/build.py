"""Builds an EngineCore from EngineArgs: model folder, device, tokenizer, runner, scheduler."""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Any

import torch

from banyan.args import EngineArgs, kv_addr_host, parse_bytes
from banyan.cache.no_cache import NoPrefixCache
from banyan.cache.radix import RadixCache
from banyan.cache.tier import FileStore, KVTier
from banyan.cache.tier.kv_tier import BlockStore, model_identity
from banyan.cache.tier.mooncake_store import MooncakeStore
from banyan.engine.core import EngineCore
from banyan.layers.linear import model_weight_bytes
from banyan.mem.allocator import SlotAllocator
from banyan.mem.prefault import PoolPrefaulter
from banyan.model_files import (generation_config, gguf_source, load_engine_tokenizer,
                                resolve_model_dir)
from banyan.runner.model_runner import ModelRunner
from banyan.runner.step import ModelStepRunner
from banyan.runner.threads import ThreadGovernor
from banyan.sampling.sampler import Sampler
from banyan.scheduler import Scheduler, SchedulerConfig
from banyan.scheduler.builder import BudgetConfig
from banyan.scheduler.policy import PolicyConfig
from banyan.scheduler.speculation import Proposer, SpeculationConfig
from banyan.spec.draft import DraftProposer
from banyan.spec.ngram import NgramProposer

logger = logging.getLogger(__name__)


def eos_token_ids(model_dir: Path, tokenizer: Any, hf_config: Any) -> frozenset[int]:
    """EOS ids from the tokenizer, the model config and generation_config.json."""
    ids: set[int] = set()
    candidates: list[Any] = [tokenizer.eos_token_id, getattr(hf_config, "eos_token_id", None)]
    # read as JSON: transformers' GenerationConfig would import transformers (1 s)
    candidates.append(generation_config(model_dir).get("eos_token_id"))
    for value in candidates:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def make_proposer(args: EngineArgs, target: ModelRunner) -> Proposer | None:
    """The speculative proposer EngineArgs name (None: no speculation)."""
    lookup = NgramProposer(args.spec_ngram_min, args.spec_ngram_max)
    if args.speculative_algorithm == "ngram":
        return lookup
    if args.speculative_algorithm == "draft":
        assert args.spec_draft_model is not None
        quantization = args.spec_draft_quantization
        gguf_file = gguf_source(args.spec_draft_model)
        if quantization == "gguf" and gguf_file is None:
            raise ValueError("spec_draft_quantization gguf computes with a GGUF file's blocks: "
                             "spec_draft_model must be a .gguf file (or a folder holding one)")
        draft_dir = resolve_model_dir(args.spec_draft_model)
        draft = ModelRunner(draft_dir, dtype=args.dtype, device=target.device,
                            num_slots=target.num_slots, max_rows=target.max_rows,
                            max_context=target.max_context, show_progress=not args.disable_tqdm,
                            attention_backend=args.attention_backend,
                            quantization=quantization,
                            linear_kernel="auto" if quantization in ("int8", "int4")
                            else args.linear_kernel,
                            gguf_file=gguf_file if quantization in ("auto", "gguf") else None,
                            # (its guesses decide no token, but seeded sampling's draws do)
                            batch_invariant=args.enable_deterministic_inference)
        draft.split_mixed_steps = False  # (its guesses need no exact bits: the check decides)
        if draft.vocab_size != target.vocab_size:
            logger.warning("draft vocabulary %d differs from the target's %d: is it the same "
                           "tokenizer?", draft.vocab_size, target.vocab_size)
        return DraftProposer(draft, target.vocab_size, args.spec_draft_min_confidence,
                             None if args.spec_draft_no_lookup else lookup)
    return None


def kv_identity(runner: ModelRunner) -> str:
    """What K/V computed by this runner depends on besides the tokens (model_identity)."""
    pool = runner.pool
    # K/V computed with int8 activations, or by the batch-invariant kernels, differ from the
    # default path's in their bits: not to be shared (a deterministic server would take
    # another server's bits for its own)
    act = "" if runner.activation_quant == "none" else f"|act-{runner.activation_quant}"
    act += "|batch-invariant" if runner.batch_invariant else ""
    return model_identity(runner.model, pool.dtype,
                          f"{runner.quantization}|{pool.kv_cache_dtype}{act}")


def attach_disaggregation(core: EngineCore, args: EngineArgs, runner: ModelRunner) -> None:
    """Give a prefill or decode worker its end of the KV transfer (banyan/disagg/)."""
    if args.disaggregation_mode == "null":
        return
    import zmq

    from banyan.disagg.sink import KVSink
    from banyan.disagg.source import KVSource

    ctx = zmq.Context.instance()
    kv = core.scheduler.kv
    mooncake = None
    if args.disaggregation_transfer_backend == "mooncake":
        from banyan.disagg.mooncake_transfer import MooncakeTransfer

        mooncake = MooncakeTransfer(kv_addr_host(args.disaggregation_kv_addr), runner.pool)
    if args.disaggregation_mode == "prefill":
        core.kv_source = KVSource(ctx, args.disaggregation_kv_addr, runner.pool, kv.cache,
                                  kv_identity(runner), mooncake)
        logger.info("prefill worker: K/V served at %s (%s)", core.kv_source.address,
                    args.disaggregation_transfer_backend)
    else:
        core.kv_sink = KVSink(ctx, kv, runner.pool, kv_identity(runner),
                              args.disaggregation_timeout, mooncake)
        logger.info("decode worker: fetches prompts' K/V from prefill workers (%s)",
                    args.disaggregation_transfer_backend)


def make_tier(args: EngineArgs, runner: ModelRunner) -> KVTier | None:
    """The KV tier under the prefix cache EngineArgs name (None: none)."""
    if args.hicache_backend == "none":
        return None
    from platformdirs import user_cache_dir

    budget = parse_bytes(args.hicache_size, "hicache_size")
    store: BlockStore
    if args.hicache_backend == "mooncake":
        block_bytes = runner.pool.bytes_per_slot * args.hicache_block_tokens
        store = MooncakeStore(args.hicache_mooncake_master, args.hicache_mooncake_metadata,
                              budget, block_bytes + 64 * args.hicache_block_tokens + 4096)
        where = f"Mooncake store at {args.hicache_mooncake_master}"
    else:
        directory = Path(args.hicache_dir or Path(user_cache_dir("banyan")) / "kv-tier")
        store = FileStore(directory, budget)
        where = (f"{directory} ({store.stats.files} blocks, "
                 f"{store.stats.bytes_used / 2**20:.1f} MiB)")
    identity = kv_identity(runner)
    logger.info("KV tier: %s, %s budget, blocks of %d tokens", where, args.hicache_size,
                args.hicache_block_tokens)
    return KVTier(runner.pool, store, args.hicache_block_tokens, identity)


def build_engine_core(args: EngineArgs) -> EngineCore:
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    model_dir = resolve_model_dir(args.model)
    tokenizer = load_engine_tokenizer(Path(args.tokenizer) if args.tokenizer else model_dir)
    runner = ModelRunner.from_engine_args(args, model_path=model_dir)
    cfg = runner.model_config
    max_model_len = min(args.max_model_len or cfg.max_position_embeddings, runner.max_context)
    eos = eos_token_ids(model_dir, tokenizer, cfg.hf_config)
    sampler = Sampler(cfg.vocab, runner.device, seed=args.seed, eos_token_ids=eos)
    budget = BudgetConfig(
        max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens,
        chunked_prefill_size=args.chunked_prefill_size,
    )
    policy = PolicyConfig(args.schedule_policy, args.schedule_fcfs_threshold,
                          args.in_batch_prefix_threshold)
    allocator = SlotAllocator(runner.num_slots)
    cache = NoPrefixCache() if args.no_prefix_cache else RadixCache(allocator, args.page_size)
    tier = make_tier(args, runner)
    overlap = args.overlap == "on" or (args.overlap == "auto" and runner.device.type == "cuda")
    if overlap and args.speculative_algorithm != "none":
        logger.warning("speculative decoding guesses only from known tokens: with overlap, a "
                       "decode's last token is never known when its step is built, so no "
                       "guesses are made (use --overlap off)")
    # Fewer threads while other processes hold cores, unless the user fixed the count.
    governor = (ThreadGovernor(torch.get_num_threads())
                if args.num_threads is None and runner.device.type == "cpu" else None)
    speculation = SpeculationConfig(args.speculative_num_tokens, args.speculative_max_step_tokens)
    proposer = make_proposer(args, runner)
    # Bursts of decode steps where the layer stack picks greedy tokens itself (elsewhere a
    # burst would run its first step only); speculation makes several-token steps its own way.
    bursts = runner.stack is not None and runner.stack.picks_greedy and proposer is None
    scheduler = Scheduler(
        ModelStepRunner(runner, sampler, overlap=overlap, governor=governor),
        SchedulerConfig(max_model_len=max_model_len, budget=budget, policy=policy,
                        overlap=overlap, speculation=speculation,
                        decode_steps=args.num_scheduler_steps if bursts else 1),
        allocator,
        cache,
        proposer,
        tier,
    )
    core = EngineCore(args, scheduler, tokenizer, eos, cfg.vocab, max_model_len)
    attach_disaggregation(core, args, runner)
    # With a tied head in its own layout (packed or quantized), the logits read that copy and a
    # step reads only its tokens' rows of the embedding: count the head, not the table.
    model = runner.model
    skip = (model.embed_tokens,) if model.tied_head is not None else ()
    core.weight_bytes = model_weight_bytes(model, skip=skip)
    core.kv_bytes_per_token = runner.pool.bytes_per_slot
    pools = [runner.pool] + ([proposer.runner.pool] if isinstance(proposer, DraftProposer)
                             else [])
    core.prefaulters = [PoolPrefaulter(pool.regions(), pool.num_slots) for pool in pools]
    core.quantization = runner.quantization
    core.dtype = str(runner.dtype).removeprefix("torch.")
    # The ~400k objects torch, the tokenizer and the model left behind are permanent: out of the
    # collector's sight, a full collection no longer stalls a step for ~200 ms, and the young
    # collections a step's allocations trigger stop tracing them (2.5% of a batched in-process
    # run's time on Zen 5 went to gc_collect_main before; the server process froze already).
    gc.freeze()
    return core
