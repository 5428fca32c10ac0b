"""Prompt logprobs computed in the forward equal transformers' float32 log_softmax at every prompt
position: whole prompts, prompts cut into chunked-prefill chunks, a prompt whose prefix is already
in the prefix cache (recomputed, not read), max_new_tokens=0, and under overlap scheduling."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from banyan import Engine
from banyan.sampling.params import SamplingParams
from banyan.scheduler import RequestUpdate
from tests.hf_reference import hf_model

TOLERANCE = 1e-4


def hf_prompt_logprobs(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i is the log-distribution that scores prompt token i + 1."""
    model = hf_model(str(model_dir))
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def run(engine: Engine, prompts: list[list[int]],
        params: SamplingParams) -> dict[str, RequestUpdate]:
    """Add all prompts, step to the end; per request id, its update carrying prompt logprobs
    (and the tokens of all its updates)."""
    rids = [engine.add_request(input_ids=p, params=params.copy()).rid for p in prompts]
    found: dict[str, RequestUpdate] = {}
    tokens: dict[str, list[int]] = {r: [] for r in rids}
    while engine.core.has_work:
        for u in engine.step():
            tokens[u.rid].extend(u.new_token_ids)
            if u.prompt_logprobs:
                assert u.rid not in found, "prompt logprobs are sent once"
                found[u.rid] = u
    for rid, u in found.items():
        u.new_token_ids = tokens[rid]
    return {r: found[r] for r in rids}


def check(model_dir: Path, prompt: list[int], update: RequestUpdate, top_k: int) -> None:
    ref = hf_prompt_logprobs(model_dir, prompt)
    got = update.prompt_logprobs
    assert len(got) == len(prompt) - 1
    for i, entry in enumerate(got):
        assert entry.token_id == prompt[i + 1]
        value = ref[i, prompt[i + 1]].item()
        assert abs(entry.logprob - value) < TOLERANCE, i
        assert 1 + int((ref[i] > value + TOLERANCE).sum()) <= entry.rank \
            <= 1 + int((ref[i] > value - TOLERANCE).sum())
        values, ids = ref[i].topk(top_k)
        assert len(entry.top_ids) == top_k
        assert torch.allclose(torch.tensor(entry.top_logprobs), values, atol=TOLERANCE)
        # ids may swap only between (near-)ties
        for got_id, want_id, value in zip(entry.top_ids, ids.tolist(), values.tolist(),
                                          strict=True):
            assert got_id == want_id or abs(ref[i, got_id].item() - value) < TOLERANCE


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_prompt_logprobs_match_transformers(llama_dir: Path, overlap: str) -> None:
    gen = torch.Generator().manual_seed(7)
    short = torch.randint(3, 500, (23,), generator=gen).tolist()
    long = torch.randint(3, 500, (150,), generator=gen).tolist()  # 3 chunks of 64
    with Engine(str(llama_dir), dtype="float32", device="cpu", disable_tqdm=True,
                chunked_prefill_size=64, max_prefill_tokens=64, kv_cache_memory="16MiB",
                overlap=overlap) as engine:
        params = SamplingParams(max_new_tokens=3, temperature=0, prompt_logprobs=3)
        out = run(engine, [short, long], params)
        check(llama_dir, short, out[next(iter(out))], 3)
        long_update = list(out.values())[1]
        check(llama_dir, long, long_update, 3)
        # The long prompt is now in the prefix cache: a second request sharing its first 120
        # tokens recomputes them (K/V is cached, logits are not) and reports no cached tokens.
        assert engine.explain_prefix(input_ids=long)["matched"] >= 120
        second = long[:120] + [5, 6, 7]
        again = run(engine, [second], params.copy(max_new_tokens=0))
        update = next(iter(again.values()))
        check(llama_dir, second, update, 3)
        assert update.new_token_ids == [] and update.finish_reason.value == "length"
        assert update.cached_tokens == 0
        # Generation is unchanged by asking for prompt logprobs.
        plain = run_plain(engine, long)
        assert plain == long_update.new_token_ids


def run_plain(engine: Engine, prompt: list[int]) -> list[int]:
    rid = engine.add_request(input_ids=prompt,
                             params=SamplingParams(max_new_tokens=3, temperature=0)).rid
    tokens: list[int] = []
    while engine.core.has_work:
        for u in engine.step():
            if u.rid == rid:
                tokens.extend(u.new_token_ids)
    return tokens


def test_prompt_logprobs_parameter_is_validated() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21).validate()
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=True).validate()  # type: ignore[arg-type]
