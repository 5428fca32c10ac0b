"""Speculative decoding on the real runner: outputs never change (greedy token for token, seeded
sampling draw for draw, unseeded sampling in distribution), whatever the proposer, batching,
chunking, prefix cache or retraction; the server's streaming and metrics (the controller and the
lookup, model-free: test_spec_controller.py)."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from banyan import Engine, SamplingParams
from banyan.batch import ForwardBatch, RowPrefix, SamplingRow
from banyan.model_files import resolve_model_dir
from banyan.runner.model_runner import ModelRunner
from banyan.runner.step import ModelStepRunner
from banyan.sampling.sampler import Sampler
from tests.hf_reference import hf_greedy
from tests.test_engine import SETTINGS, check_pool_empty, prompts_1_to_300


def spec_engine(model: Path, algo: str, draft: Path | None = None, **kwargs: object) -> Engine:
    extra = {"spec_draft_model": str(draft)} if draft is not None else {}
    # 4 guesses: the short pool of the "retraction" setting is sized for it (guesses never
    # evict or retract, so with more of them that setting stops retracting)
    kwargs.setdefault("speculative_num_tokens", 4)
    # every guess, however unsure: a random tiny model is unsure of all of them
    kwargs.setdefault("spec_draft_min_confidence", 0.0)
    # the draft model's own guesses (a random model repeats itself: lookups would stand in for
    # many of them; test_a_lookup_stands_in_for_the_draft_where_the_text_repeats has them)
    kwargs.setdefault("spec_draft_no_lookup", True)
    kwargs.setdefault("dtype", "float32")
    engine = Engine(str(model), device="cpu", disable_tqdm=True, overlap="off",
                    speculative_algorithm=algo, speculative_max_step_tokens=64,
                    spec_ngram_min=1, **extra, **kwargs)
    engine.core.scheduler.config.check_integrity = True
    return engine


def run_greedy(engine: Engine, prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
    outs = engine.generate(input_ids=prompts, sampling_params=[
        SamplingParams(max_new_tokens=n, temperature=0.0) for n in max_new])
    return [o.output_ids for o in outs]


CASES = [  # (arch, proposer, draft arch, setting)
    ("llama", "ngram", None, "retraction"),
    ("llama", "draft", "llama", "retraction"),  # the target as its own draft: all accepted
    ("llama", "draft", "qwen3", "chunked"),  # an unrelated draft: mostly rejected
    ("mistral", "ngram", None, "chunked"),
    ("qwen2", "draft", "llama", "one-big-step"),
    ("qwen3", "ngram", None, "one-big-step"),
]


@pytest.mark.parametrize("arch,algo,draft,setting", CASES)
def test_greedy_identical_to_transformers(model_dirs: dict[str, Path], arch: str, algo: str,
                                          draft: str | None, setting: str) -> None:
    target = model_dirs[arch]
    prompts = prompts_1_to_300(7, seed=3)
    max_new = [6 + (5 * i) % 23 for i in range(len(prompts))]
    expected = [hf_greedy(target, p, n) for p, n in zip(prompts, max_new, strict=True)]
    guesses = 4 if setting == "retraction" else 8  # the engine's default elsewhere
    with spec_engine(target, algo, model_dirs[draft] if draft else None,
                     speculative_num_tokens=guesses, **SETTINGS[setting]) as engine:
        assert run_greedy(engine, prompts, max_new) == expected
        stats = engine.core.scheduler.speculation.stats
        assert stats.num_drafts > 0  # guesses were made and checked
        if algo == "ngram":  # random models repeat themselves: some guesses are right
            assert stats.num_accepted_tokens > 0
        if draft == arch:
            assert stats.acceptance_rate > 0.9
        if setting == "retraction":
            assert engine.core.scheduler.total_retractions > 0
        check_pool_empty(engine)
        assert not engine.core.scheduler.speculation._state  # every request forgotten


@pytest.mark.parametrize("kv,dtype", [("int8", "float32"), ("fp8_e4m3", "float32"),
                                      ("int8", "bfloat16")])
def test_speculation_over_a_quantized_pool_changes_no_token(model_dirs: dict[str, Path],
                                                            kv: str, dtype: str) -> None:
    """Checks store and read a quantized pool's codes (and roll rejected ones back) as decodes
    do: the same greedy tokens with speculation as without, over the same storage (a bf16
    model's int8 pool: its scores and values in int8 on VNNI, where the CPU has it)."""
    target = model_dirs["llama"]
    prompts = prompts_1_to_300(5, seed=4)
    max_new = [8 + (7 * i) % 19 for i in range(len(prompts))]
    with Engine(str(target), dtype=dtype, device="cpu", disable_tqdm=True, overlap="off",
                kv_cache_dtype=kv) as plain:
        want = run_greedy(plain, prompts, max_new)
    # the target as its own draft: most guesses accepted (its own pool is unquantized: with
    # fp8 not all), so checks keep tokens and roll rejected ones back
    with spec_engine(target, "draft", target, kv_cache_dtype=kv, dtype=dtype) as engine:
        assert run_greedy(engine, prompts, max_new) == want
        assert engine.core.scheduler.speculation.stats.acceptance_rate > 0.5
        check_pool_empty(engine)


def test_seeded_sampling_draws_the_same_tokens(model_dirs: dict[str, Path]) -> None:
    """A seeded row's noise depends on (seed, position) only: checking guesses changes nothing."""
    target = model_dirs["llama"]
    prompts = prompts_1_to_300(6, seed=5)
    params = [SamplingParams(max_new_tokens=20, temperature=t, top_p=0.9, seed=100 + i,
                             ignore_eos=True) for i, t in enumerate([0.7, 1.0] * 3)]
    with Engine(str(target), dtype="float32", device="cpu", disable_tqdm=True,
                overlap="off") as plain:
        want = [o.output_ids for o in plain.generate(input_ids=prompts, sampling_params=params)]
    with spec_engine(target, "draft", target) as engine:
        got = [o.output_ids for o in engine.generate(input_ids=prompts, sampling_params=params)]
        assert engine.core.scheduler.speculation.stats.num_accepted_tokens > 0
    assert got == want


def test_int4_copy_of_the_target_as_its_draft(model_dirs: dict[str, Path]) -> None:
    """--spec-draft-quantization int4 on the target's own checkpoint: the draft runs quantized
    linears, its guesses differ where int4 moves an argmax, and the output is still the target's."""
    target = model_dirs["llama"]
    prompts = prompts_1_to_300(4, seed=8)
    max_new = [16, 9, 21, 12]
    expected = [hf_greedy(target, p, n) for p, n in zip(prompts, max_new, strict=True)]
    with spec_engine(target, "draft", target, spec_draft_quantization="int4") as engine:
        draft = engine.core.scheduler.speculation.proposer
        assert draft.runner.quantization == "int4"
        assert run_greedy(engine, prompts, max_new) == expected
        assert engine.core.scheduler.speculation.stats.num_accepted_tokens > 0
        check_pool_empty(engine)


def test_a_gguf_draft_computes_from_its_own_blocks(tmp_path: Path, tokenizer_dir: Path,
                                                   llama_dir: Path) -> None:
    """A GGUF draft runs the file's blocks (spec_draft_quantization auto): beside the float32
    model dequantized from the same file, nearly every guess holds; gguf asked of a folder
    without one is refused by name."""
    from tests.gguf_helpers import write_gguf

    path = write_gguf(tmp_path / "m.gguf", tokenizer_dir, wtype="Q4_1", tied=True, seed=3)
    target = resolve_model_dir(str(path), show_progress=False)
    prompts = prompts_1_to_300(3, seed=9)
    max_new = [14, 8, 19]
    expected = [hf_greedy(target, p, n) for p, n in zip(prompts, max_new, strict=True)]
    with spec_engine(target, "draft", path) as engine:
        spec = engine.core.scheduler.speculation
        assert spec.proposer.runner.quantization == "gguf"
        assert run_greedy(engine, prompts, max_new) == expected
        assert spec.stats.acceptance_rate > 0.9
        check_pool_empty(engine)
    with pytest.raises(ValueError, match="spec_draft_model must be a .gguf"):
        spec_engine(llama_dir, "draft", llama_dir, spec_draft_quantization="gguf")


def test_a_lookup_stands_in_for_the_draft_where_the_text_repeats(
        model_dirs: dict[str, Path]) -> None:
    """With the lookup on (the default), requests whose text repeats take the continuation
    found earlier in it instead of the draft's guesses; outputs stay transformers' greedy ones,
    and the draft, which never saw those tokens, catches up on them at its next guess."""
    target = model_dirs["llama"]
    pattern = [11, 23, 35, 47, 59, 71, 83]
    prompts = [pattern * 12, [5] + pattern * 9 + [13, 17], prompts_1_to_300(1, seed=5)[0]]
    max_new = [24, 30, 20]
    expected = [hf_greedy(target, p, n) for p, n in zip(prompts, max_new, strict=True)]
    with spec_engine(target, "draft", model_dirs["qwen3"], spec_draft_no_lookup=False,
                     speculative_num_tokens=6) as engine:
        assert run_greedy(engine, prompts, max_new) == expected
        spec = engine.core.scheduler.speculation
        assert spec.proposer.looked_up > 0 and spec.stats.num_accepted_tokens > 0
        check_pool_empty(engine)
        draft_slots = spec.proposer.allocator
        assert draft_slots.num_free == draft_slots.capacity  # every draft sequence let go
    with spec_engine(target, "draft", model_dirs["qwen3"], speculative_num_tokens=6) as engine:
        assert run_greedy(engine, prompts, max_new) == expected
        assert engine.core.scheduler.speculation.proposer.looked_up == 0


def test_draft_stops_guessing_after_a_guess_it_doubts(model_dirs: dict[str, Path]) -> None:
    """spec_draft_min_confidence: a request's guesses end with the first one the draft gives
    less probability than that (1.0: every first guess), and the output stays the target's."""
    target = model_dirs["llama"]
    prompts = prompts_1_to_300(3, seed=5)
    max_new = [12, 7, 15]
    expected = [hf_greedy(target, p, n) for p, n in zip(prompts, max_new, strict=True)]
    guesses_per_draft = {}
    for confidence in (0.0, 1.0):
        with spec_engine(target, "draft", target, spec_draft_min_confidence=confidence) as engine:
            assert run_greedy(engine, prompts, max_new) == expected
            stats = engine.core.scheduler.speculation.stats
            guesses_per_draft[confidence] = stats.num_draft_tokens / stats.num_drafts
            check_pool_empty(engine)
    assert guesses_per_draft[1.0] == 1.0
    assert guesses_per_draft[0.0] > 2.0  # the target as its own draft: every guess accepted


def test_top_token_and_probability() -> None:
    from banyan.sampling.greedy import top_token_and_probability

    torch.manual_seed(0)
    logits = torch.randn(5, 300) * 4
    logits[:, 250:] = -math.inf  # a vocabulary padded past the real one
    logits[2, 7] = 50.0  # a sure guess
    tokens, probability = top_token_and_probability(logits)
    want = torch.softmax(logits.double(), dim=-1).max(dim=-1)
    assert tokens == want.indices.tolist()
    assert probability == pytest.approx(want.values.tolist(), rel=1e-5)
    assert probability[2] == pytest.approx(1.0)


def test_stops_logprobs_n_and_abort_inside_accepted_runs(llama_dir: Path) -> None:
    prompt = [[20, 21, 22, 20, 21, 22, 20, 21]]
    with Engine(str(llama_dir), dtype="float32", device="cpu", disable_tqdm=True,
                overlap="off") as plain:
        [full] = plain.generate(input_ids=prompt, sampling_params=SamplingParams(
            max_new_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2))
    with spec_engine(llama_dir, "draft", llama_dir) as engine:
        [spec] = engine.generate(input_ids=prompt, sampling_params=SamplingParams(
            max_new_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2))
        assert spec.output_ids == full.output_ids
        for a, b in zip(spec.outputs[0].logprobs, full.outputs[0].logprobs, strict=True):
            assert a.token_id == b.token_id and a.top_ids == b.top_ids
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        # A stop token and a stop string in the middle of what a verified run accepts.
        stop_id = full.output_ids[9]
        cut = full.output_ids.index(stop_id) + 1
        [by_id] = engine.generate(input_ids=prompt, sampling_params=SamplingParams(
            max_new_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id]))
        assert by_id.output_ids == full.output_ids[:cut] and by_id.finish_reason == "stop"
        stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
        [by_text] = engine.generate(input_ids=prompt, sampling_params=SamplingParams(
            max_new_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop]))
        assert by_text.text == full.text[: full.text.index(stop)]
        [many] = engine.generate(input_ids=prompt, sampling_params=SamplingParams(
            max_new_tokens=13, temperature=0.0, ignore_eos=True, n=3))
        assert [o.output_ids for o in many.outputs] == [full.output_ids[:13]] * 3
        # Abort mid-generation: nothing leaks (target KV, draft KV, speculation state).
        stream = engine.stream(input_ids=prompt[0], sampling_params=SamplingParams(
            max_new_tokens=200, temperature=0.0, ignore_eos=True))
        next(stream)
        stream.close()
        check_pool_empty(engine)
        draft = engine.core.scheduler.speculation.proposer
        assert draft.allocator.num_free == draft.allocator.capacity


def _target_probs(runner: ModelRunner, context: list[int], temperature: float,
                  top_p: float) -> torch.Tensor:
    """The target's distribution after `context` (float64), from the runner's own logits."""
    n = len(context)
    logits = runner.forward(ForwardBatch(rows=[0], prefix_lens=[0], extend_lens=[n],
                                         input_ids=context, out_slots=list(range(1, n + 1)),
                                         sample_indices=[0]))[0].double()
    probs = torch.softmax(logits / temperature, -1)
    sorted_p, order = probs.sort(descending=True)
    keep = (sorted_p.cumsum(0) - sorted_p) < top_p
    out = torch.zeros_like(probs)
    out[order[keep]] = sorted_p[keep]
    return out / out.sum()


def _chi_square_ok(counts: Counter[int], probs: torch.Tensor, draws: int) -> bool:
    """Pearson's test at p = 0.001 over the tokens expected >= 5 times (the rest lumped)."""
    expected = (probs * draws).tolist()
    big = [t for t, e in enumerate(expected) if e >= 5]
    observed = [counts.get(t, 0) for t in big] + [draws - sum(counts.get(t, 0) for t in big)]
    exp = [expected[t] for t in big] + [draws - sum(expected[t] for t in big)]
    if exp[-1] < 5:  # too little left over to be a category
        observed[-2] += observed.pop()
        exp[-2] += exp.pop()
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, exp, strict=True))
    df = len(exp) - 1
    z = 3.090  # the normal quantile of 1 - 0.001; Wilson-Hilferty for the chi-square quantile
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < critical


def test_bad_words_and_allowed_tokens_inside_accepted_runs(llama_dir: Path) -> None:
    """Bans that read the output (a two-token bad word: its last token only after its first)
    hold at every guessed position: the target as its own draft proposes the banned tokens,
    and the checks must refuse them as plain decoding does."""
    prompt = [[20, 21, 22, 20, 21, 22, 20, 21]]
    greedy = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    with Engine(str(llama_dir), dtype="float32", device="cpu", disable_tqdm=True,
                overlap="off") as plain:
        [full] = plain.generate(input_ids=prompt, sampling_params=greedy)
        ids = full.output_ids
        # two different tokens in a row, at each place past the fifth: one case each, so
        # that some pair's first token is itself a guess when its second is checked
        ats = [i for i in range(5, len(ids) - 1) if ids[i] != ids[i + 1]][:8]
        allowed = sorted(set(ids) - {ids[0]})
        cases = [greedy.copy(bad_words_ids=[[ids[5]]]), greedy.copy(allowed_token_ids=allowed)]
        cases += [greedy.copy(bad_words_ids=[ids[at:at + 2]]) for at in ats]
        want = [o.output_ids for o in plain.generate(input_ids=prompt * len(cases),
                                                     sampling_params=cases)]
    first = ids.index(ids[5])  # a one-token word: banned everywhere
    assert ids[5] not in want[0] and want[0][:first] == ids[:first]
    assert set(want[1]) <= set(allowed) and want[1][0] != ids[0]
    for at, out in zip(ats, want[2:], strict=True):
        pair = ids[at:at + 2]
        assert all(out[i:i + 2] != pair for i in range(len(out) - 1))
        where = next(i for i in range(len(ids)) if ids[i:i + 2] == pair)  # its first place
        assert out[:where + 1] == ids[:where + 1]  # the ban bit right there
    with spec_engine(llama_dir, "draft", llama_dir) as engine:
        got = [o.output_ids for o in engine.generate(input_ids=prompt * len(cases),
                                                     sampling_params=cases)]
        assert got == want
        check_pool_empty(engine)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_verified_sampling_follows_the_target_distribution(llama_dir: Path, temperature: float,
                                                           top_p: float) -> None:
    """One decode step with two guesses, drawn in many rows at once (all sharing the context's
    KV): the first token follows p(. | context), the next, where the first guess was accepted,
    p(. | context + guess). The random model is made peaked (its final norm scaled) so that
    guesses are often accepted and many tokens are likely."""
    context = [40, 41, 42, 43, 44]
    rows, launches = 120, 25
    runner = ModelRunner(llama_dir, dtype="float32", num_slots=4 * rows + 64, max_rows=rows,
                         max_context=16, show_progress=False)
    with torch.no_grad():
        runner.model.norm.weight.mul_(5.0)
    step_runner = ModelStepRunner(runner, Sampler(runner.vocab_size, runner.device, seed=0))
    p0 = _target_probs(runner, context, temperature, top_p)
    guess = [int(p0.argmax()), 7]
    p1 = _target_probs(runner, context + guess[:1], temperature, top_p)
    params = SamplingParams(max_new_tokens=8, temperature=temperature, top_p=top_p)
    n_ctx = len(context) - 1  # the last context token is the decode step's input
    shared = list(range(1, n_ctx + 1))  # the context's K/V, written by _target_probs
    batch = ForwardBatch(row_prefixes=[RowPrefix(r, shared) for r in range(rows)])
    for r in range(rows):
        batch.rows.append(r)
        batch.prefix_lens.append(n_ctx)
        batch.extend_lens.append(3)
        batch.input_ids.extend([context[-1], *guess])
        batch.out_slots.extend(range(64 + 3 * r, 64 + 3 * r + 3))
        batch.sample_indices.append(r)
        batch.sampling.append(SamplingRow(params, context[:-1], [context[-1]]))
        batch.proposed.append(list(guess))
    firsts, seconds = Counter[int](), Counter[int]()
    for _ in range(launches):
        for tokens in step_runner.launch(batch).result().sampled_token_ids:
            assert 1 <= len(tokens) <= 3 and tokens[:-1] == guess[: len(tokens) - 1]
            firsts[tokens[0]] += 1
            if len(tokens) > 1:
                seconds[tokens[1]] += 1
    draws, accepted = rows * launches, sum(seconds.values())
    assert _chi_square_ok(firsts, p0, draws)
    assert accepted > 300 and _chi_square_ok(seconds, p1, accepted)
    p_guess = float(p0[guess[0]])
    assert abs(accepted / draws - p_guess) < 4 * math.sqrt(p_guess * (1 - p_guess) / draws)


# ---- the server: streaming and metrics ------------------------------------------------------


def test_server_streams_speculated_tokens_and_counts_them(llama_dir: Path,
                                                          tmp_path: Path) -> None:
    from openai import OpenAI

    from tests.server_helpers import metric_values, running_server, wait_idle_and_free

    prompt = [20, 21, 22, 20, 21, 22, 20, 21]
    with Engine(str(llama_dir), dtype="float32", device="cpu", disable_tqdm=True) as plain:
        [want] = plain.generate(input_ids=[prompt], sampling_params=SamplingParams(
            max_new_tokens=40, temperature=0.0, ignore_eos=True))
    with running_server(llama_dir, tmp_path, "--speculative-algorithm", "ngram",
                        "--spec-ngram-min", "1") as srv:
        client = OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=40,
                                           temperature=0.0, stream=True,
                                           extra_body={"ignore_eos": True})
        text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert text == want.text
        metrics = metric_values(srv.url)
        drafts = metrics[("banyan:spec_decode_num_drafts_total", ())]
        accepted = metrics[("banyan:spec_decode_num_accepted_tokens_total", ())]
        first = metrics[("banyan:spec_decode_num_accepted_tokens_per_pos_total",
                         (("position", "0"),))]
        assert drafts > 0 and accepted > 0 and first <= drafts
        info = wait_idle_and_free(srv.url)
        assert info["speculative"]["num_accepted_tokens"] == accepted
