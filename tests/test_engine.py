"""The offline Engine end to end on tiny random models: token-exact against transformers."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from banyan import Engine, SamplingParams
from tests.hf_reference import hf_greedy

# Per-token KV of the tiny models is 512 bytes (2 layers x K,V x 2 heads x 16 dims x fp32).
TINY_KV_BYTES_PER_TOKEN = 512


def prompts_1_to_300(n: int = 16, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 300] + [rng.randint(2, 299) for _ in range(n - 2)]
    return [[rng.randrange(3, 512) for _ in range(length)] for length in lengths]


@pytest.fixture(scope="module")
def workload(llama_dir: Path) -> tuple[list[list[int]], list[int], list[list[int]]]:
    prompts = prompts_1_to_300()
    max_new = [4 + (7 * i) % 29 for i in range(len(prompts))]
    expected = [hf_greedy(llama_dir, p, n) for p, n in zip(prompts, max_new)]
    return prompts, max_new, expected


def greedy(max_new: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=0.0)


def check_pool_empty(engine: Engine) -> None:
    sched = engine.core.scheduler
    assert not sched.has_work
    # Idle: every slot is free or held (unlocked) by the prefix cache.
    assert sched.kv.cache.protected_size == 0
    assert sched.kv.allocator.num_free + sched.kv.cache.evictable_size == sched.kv.capacity
    sched.kv.check_integrity(sched.running)


SETTINGS = {
    "one-big-step": dict(max_prefill_tokens=8192, chunked_prefill_size=8192),
    "chunked": dict(max_prefill_tokens=64, chunked_prefill_size=37),
    "retraction": dict(kv_cache_memory=str(700 * TINY_KV_BYTES_PER_TOKEN),
                       max_prefill_tokens=256, chunked_prefill_size=128),
}


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sequential"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_matches_transformers(llama_dir: Path, workload, setting: str,
                                     overlap: bool) -> None:
    prompts, max_new, expected = workload
    with Engine(str(llama_dir), dtype="float32", device="cpu", disable_tqdm=True,
                overlap="on" if overlap else "off", **SETTINGS[setting]) as engine:
        engine.core.scheduler.config.check_integrity = True
        outs = engine.generate(input_ids=prompts, sampling_params=[greedy(n) for n in max_new])
        for i, out in enumerate(outs):
            assert out.output_ids == expected[i], f"prompt {i} (len {len(prompts[i])})"
            assert out.prompt_tokens == len(prompts[i])
            assert out.finish_reason in ("stop", "length")
        if setting == "retraction":
            assert engine.core.scheduler.total_retractions > 0
        check_pool_empty(engine)


def test_requests_arriving_while_others_decode(llama_dir: Path, workload) -> None:
    prompts, max_new, expected = workload
    with Engine(str(llama_dir), dtype="float32", device="cpu", disable_tqdm=True,
                max_prefill_tokens=96, chunked_prefill_size=64) as engine:
        engine.core.scheduler.config.check_integrity = True
        got: dict[str, list[int]] = {}
        pending = list(range(len(prompts)))
        while pending or engine.core.has_work:
            for _ in range(2):  # two arrivals per step
                if pending:
                    i = pending.pop(0)
                    engine.add_request(input_ids=prompts[i], params=greedy(max_new[i]),
                                       request_id=str(i))
            for update in engine.step():
                got.setdefault(update.rid, []).extend(update.new_token_ids)
        for i in range(len(prompts)):
            assert got[str(i)] == expected[i]
        check_pool_empty(engine)


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "qwen3"])
def test_greedy_matches_transformers_other_archs(model_dirs: dict[str, Path], arch: str) -> None:
    prompts = prompts_1_to_300(6, seed=3)
    expected = [hf_greedy(model_dirs[arch], p, 12) for p in prompts]
    for overlap in (True, False):
        with Engine(str(model_dirs[arch]), dtype="float32", device="cpu", disable_tqdm=True,
                    chunked_prefill_size=50, max_prefill_tokens=100,
                    overlap="on" if overlap else "off") as engine:
            outs = engine.generate(input_ids=prompts, sampling_params=greedy(12))
            assert [o.output_ids for o in outs] == expected, f"overlap={overlap}"


def test_overlap_changes_no_output(llama_dir: Path) -> None:
    """Seeded sampling with penalties, stop strings, EOS, the prefix cache on and off: the same
    tokens and text with overlap on and off."""
    prompts = prompts_1_to_300(8, seed=5)
    prompts += [prompts[2][:150] + p for p in prompts[3:6]]  # shared prefixes for the cache
    params = [SamplingParams(max_new_tokens=5 + 3 * i, temperature=0.9, top_p=0.95,
                             seed=100 + i, repetition_penalty=1.3 if i % 2 else 1.0,
                             frequency_penalty=0.5 if i % 3 == 0 else 0.0,
                             min_new_tokens=2 if i == 4 else 0)
              for i in range(len(prompts))]
    results = {}
    for overlap in (True, False):
        for no_cache in (True, False):
            with Engine(str(llama_dir), dtype="float32", device="cpu", disable_tqdm=True,
                        overlap="on" if overlap else "off", no_prefix_cache=no_cache,
                        chunked_prefill_size=64, max_prefill_tokens=128) as engine:
                engine.core.scheduler.config.check_integrity = True
                outs = engine.generate(input_ids=prompts, sampling_params=params)
                results[overlap, no_cache] = [(o.output_ids, o.text, o.finish_reason)
                                              for o in outs]
                check_pool_empty(engine)
    first = results[True, True]
    assert all(r == first for r in results.values())
    assert {reason for _, _, reason in first} <= {"stop", "length"}


@pytest.fixture(scope="module")
def engine(llama_dir: Path) -> Engine:
    with Engine(str(llama_dir), dtype="float32", device="cpu", disable_tqdm=True) as eng:
        eng.core.scheduler.config.check_integrity = True
        yield eng


def test_text_prompts_stream_and_generate_agree(engine: Engine) -> None:
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    [out] = engine.generate("def main():\n    return", params)
    chunks = list(engine.stream("def main():\n    return", params))
    assert "".join(c.text for c in chunks) == out.text
    assert [t for c in chunks for t in c.token_ids] == out.output_ids
    assert chunks[-1].finish_reason == "length"
    assert out.text == engine.tokenizer.decode(out.output_ids, skip_special_tokens=True)
    check_pool_empty(engine)


def test_same_seed_same_tokens_in_different_batches(engine: Engine) -> None:
    params = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=1234,
                            ignore_eos=True)
    [alone] = engine.generate(input_ids=[[5, 6, 7]], sampling_params=params)
    others = SamplingParams(max_new_tokens=10, temperature=1.0, ignore_eos=True)
    batch = engine.generate(input_ids=[[9, 9], [5, 6, 7], list(range(3, 40))],
                            sampling_params=[others, params, others])
    assert batch[1].output_ids == alone.output_ids
    [other_seed] = engine.generate(input_ids=[[5, 6, 7]],
                                   sampling_params=params.copy(seed=99))
    assert other_seed.output_ids != alone.output_ids


def test_faulting_the_pool_in_keeps_cached_prefixes(engine: Engine) -> None:
    # what an idle server does between requests: the cached prompt's K/V survive it
    prompt = [list(range(20, 90))]
    [before] = engine.generate(input_ids=prompt, sampling_params=greedy(12))
    engine.core.populate_kv()
    assert all(p.done for p in engine.core.prefaulters) and not engine.core.prefault_kv()
    [after] = engine.generate(input_ids=prompt, sampling_params=greedy(12))
    assert after.cached_tokens >= 64 and after.output_ids == before.output_ids
    check_pool_empty(engine)


def test_top_k_1_equals_greedy(engine: Engine) -> None:
    prompt = [[11, 12, 13, 14]]
    [g] = engine.generate(input_ids=prompt, sampling_params=greedy(12))
    [k1] = engine.generate(input_ids=prompt, sampling_params=SamplingParams(
        max_new_tokens=12, temperature=0.7, top_k=1))
    assert g.output_ids == k1.output_ids


def test_stop_token_ids_and_stop_strings(engine: Engine) -> None:
    prompt = [[20, 21, 22]]
    [full] = engine.generate(input_ids=prompt, sampling_params=SamplingParams(
        max_new_tokens=24, temperature=0.0, ignore_eos=True))
    stop_id = full.output_ids[5]
    first = full.output_ids.index(stop_id)
    [by_id] = engine.generate(input_ids=prompt, sampling_params=SamplingParams(
        max_new_tokens=24, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id]))
    assert by_id.output_ids == full.output_ids[: first + 1]
    assert by_id.finish_reason == "stop"
    # A stop string taken from the middle of the text: output ends right before it.
    text = full.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "pick a visible stop string"
    [by_text] = engine.generate(input_ids=prompt, sampling_params=SamplingParams(
        max_new_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop]))
    assert by_text.finish_reason == "stop"
    assert by_text.text == text[: text.index(stop)]
    check_pool_empty(engine)


def test_n_samples_and_logprobs(engine: Engine) -> None:
    params = SamplingParams(max_new_tokens=8, temperature=1.0, n=3, seed=7, logprobs=2,
                            ignore_eos=True)
    [out] = engine.generate(input_ids=[[30, 31, 32]], sampling_params=params)
    assert len(out.outputs) == 3
    assert len({tuple(o.output_ids) for o in out.outputs}) > 1
    for sample in out.outputs:
        assert len(sample.output_ids) == 8 and len(sample.logprobs) == 8
        for token, lp in zip(sample.output_ids, sample.logprobs):
            assert lp.token_id == token and lp.logprob <= 0.0
            assert len(lp.top_ids) == 2 and lp.top_logprobs[0] >= lp.top_logprobs[1]
    assert out.completion_tokens == 24


BAD_INPUTS = [
    (dict(prompts=[""]), "empty"),
    (dict(input_ids=[[]]), "empty"),
    (dict(prompts=["hi"], sampling_params=SamplingParams(max_new_tokens=-1)), "max_new_tokens"),
    (dict(prompts=["hi"], sampling_params=SamplingParams(top_p=0.0)), "top_p"),
    (dict(prompts=["hi"], sampling_params=SamplingParams(top_p=1.5)), "top_p"),
    (dict(input_ids=[[5] * 1024]), "context length"),
    (dict(input_ids=[[100_000]]), "vocabulary"),
]


@pytest.mark.parametrize("kwargs,message", BAD_INPUTS)
def test_bad_input_is_a_value_error_and_engine_keeps_serving(engine: Engine, kwargs,
                                                             message) -> None:
    with pytest.raises(ValueError, match=message):
        engine.generate(**kwargs)
    check_pool_empty(engine)
    [ok] = engine.generate(input_ids=[[3, 4, 5]], sampling_params=greedy(4))
    assert len(ok.output_ids) == 4


def test_bad_request_in_a_batch_leaves_nothing_queued(engine: Engine) -> None:
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(input_ids=[[3, 4], [5, 6]],
                        sampling_params=[greedy(4), SamplingParams(top_p=2.0)])
    check_pool_empty(engine)


def test_unknown_model_folder(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        Engine(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="config.json"):
        Engine(str(tmp_path))


def test_abort_mid_generation_frees_everything(engine: Engine) -> None:
    group = engine.add_request(input_ids=list(range(3, 200)), params=greedy(100),
                               request_id="victim")
    engine.add_request(input_ids=[7, 8, 9], params=greedy(5), request_id="bystander")
    got: list[int] = []
    for _ in range(3):
        got += [t for u in engine.step() if u.rid == "bystander" for t in u.new_token_ids]
    kv = engine.core.scheduler.kv
    assert kv.cache.protected_size + kv.allocator.num_free < kv.capacity
    engine.abort(group.rid)
    while engine.core.has_work:
        for u in engine.step():
            assert u.rid == "bystander"
            got.extend(u.new_token_ids)
    [alone] = engine.generate(input_ids=[[7, 8, 9]], sampling_params=greedy(5))
    assert got == alone.output_ids
    check_pool_empty(engine)


def test_stream_closed_early_aborts(engine: Engine) -> None:
    stream = engine.stream(input_ids=[3, 4, 5], sampling_params=SamplingParams(
        max_new_tokens=50, ignore_eos=True))
    next(stream)
    stream.close()
    check_pool_empty(engine)


@pytest.mark.cuda
@pytest.mark.parametrize("setting", ["chunked", "retraction"])
def test_greedy_matches_transformers_on_cuda(llama_dir: Path, workload, setting: str) -> None:
    """The same equivalence on a GPU, in float32 (bf16 logits are checked in test_models)."""
    prompts, max_new, expected = workload
    with Engine(str(llama_dir), dtype="float32", device="cuda", disable_tqdm=True,
                **SETTINGS[setting]) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=[greedy(n) for n in max_new])
        assert [o.output_ids for o in outs] == expected
        check_pool_empty(engine)
