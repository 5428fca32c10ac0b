"""Sampler: greedy, seeded randomness, the exact sampling distribution, filters, penalties, bias,
min_new_tokens and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from banyan.batch import SamplingRow
from banyan.sampling.params import SamplingParams
from banyan.sampling.penalties import TokenStats, apply_penalties
from banyan.sampling.filters import keep_mask_sorted
from banyan.sampling.sampler import Sampler, mix_seed

# Upper 0.1% points of the chi-square distribution (scipy is not a dependency):
# scipy.stats.chi2.ppf(0.999, df) for df = 2, 3, 7. The draws use fixed seeds, so the test is
# deterministic; the critical value says a correct sampler passes at any seed but 1 in 1000.
CHI2_999 = {2: 13.816, 3: 16.266, 7: 24.322}


def row(output_ids: list[int] | None = None, prompt_ids: list[int] | None = None,
        seed: int | None = None, **params: object) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), prompt_ids or [], output_ids or [], seed=seed)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum().double()
    return float(((counts.double() - expected) ** 2 / expected).sum())


def draw_counts(sampler: Sampler, logits_row: torch.Tensor, n: int,
                **params: object) -> torch.Tensor:
    """Token histogram of n rows sampling from the same logits in one batch."""
    logits = logits_row.unsqueeze(0).expand(n, -1).contiguous()
    tokens = sampler.sample(logits, [row(**params) for _ in range(n)]).next_tokens
    return torch.bincount(torch.tensor(tokens), minlength=logits_row.numel())


# --- greedy ---------------------------------------------------------------------------------------

def test_greedy_is_argmax_and_top_k_one_is_greedy() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 100)
    sampler = Sampler(100, seed=1)
    want = logits.argmax(-1).tolist()
    assert sampler.sample(logits, [row(temperature=0.0) for _ in range(6)]).next_tokens == want
    top1 = [row(temperature=1.5, top_k=1, seed=s if s % 2 else None) for s in range(6)]
    assert sampler.sample(logits, top1).next_tokens == want
    # A temperature too small to divide by safely is greedy, not NaN.
    assert sampler.sample(logits, [row(temperature=1e-7) for _ in range(6)]).next_tokens == want


def test_mixed_batch_greedy_rows_stay_greedy() -> None:
    torch.manual_seed(1)
    logits = torch.randn(8, 50)
    rows = [row(temperature=0.0) if i % 2 == 0 else row(temperature=1.0) for i in range(8)]
    tokens = Sampler(50, seed=0).sample(logits, rows).next_tokens
    assert tokens[0::2] == logits[0::2].argmax(-1).tolist()


def test_input_logits_untouched_and_padded_vocab_never_sampled() -> None:
    torch.manual_seed(2)
    logits = torch.randn(4, 40)
    logits[:, 32:] = 1000.0  # lm_head padding past the real vocabulary
    before = logits.clone()
    rows = [row(temperature=0.0), row(top_p=0.5), row(repetition_penalty=2.0, output_ids=[33]),
            row(logit_bias={3: 1.0}, logprobs=5)]
    result = Sampler(32, seed=0).sample(logits, rows)
    assert all(t < 32 for t in result.next_tokens)
    assert all(t < 32 for t in result.logprobs[3].top_ids)
    assert torch.equal(logits, before)


# --- seeds ----------------------------------------------------------------------------------------

def _generate(sampler: Sampler, target: torch.Tensor, position: int, batch: int, seed: int,
              steps: int, **params: object) -> list[int]:
    """Tokens of a seeded row at `position` in batches of `batch` unrelated rows, over steps."""
    out: list[int] = []
    for _ in range(steps):
        logits = torch.randn(batch, target.numel())
        logits[position] = target
        rows = [row(temperature=1.0) for _ in range(batch)]
        rows[position] = row(output_ids=list(out), seed=seed, **params)
        out.append(sampler.sample(logits, rows).next_tokens[position])
    return out


@pytest.mark.parametrize("params", [{}, {"temperature": 0.8, "top_p": 0.9},
                                    {"top_k": 20, "min_p": 0.01}])
def test_same_seed_same_tokens_whatever_the_batch(params: dict[str, object]) -> None:
    torch.manual_seed(3)
    target = torch.randn(200)  # flat enough that tokens vary from step to step
    a = _generate(Sampler(200, seed=1), target, position=0, batch=1, seed=42, steps=12, **params)
    b = _generate(Sampler(200, seed=2), target, position=5, batch=9, seed=42, steps=12, **params)
    assert a == b
    assert len(set(a)) > 3  # really sampled, not a constant


def test_different_seeds_differ_and_engine_seed_is_reproducible() -> None:
    torch.manual_seed(4)
    target = torch.zeros(1000)
    runs = [_generate(Sampler(1000, seed=0), target, 0, 3, seed=s, steps=8) for s in (1, 2)]
    assert runs[0] != runs[1]
    logits = torch.zeros(16, 1000)
    unseeded = [row() for _ in range(16)]
    assert (Sampler(1000, seed=7).sample(logits, unseeded).next_tokens
            == Sampler(1000, seed=7).sample(logits, unseeded).next_tokens)
    assert mix_seed(1, 0) != mix_seed(0, 1) and mix_seed(-1, 3) >= 0


def test_row_seed_overrides_request_seed() -> None:
    logits = torch.zeros(2, 1000)
    params = SamplingParams(seed=5)
    rows = [SamplingRow(params, [], [], seed=None), SamplingRow(params, [], [], seed=6)]
    same = [SamplingRow(params, [], [], seed=5), SamplingRow(params, [], [], seed=6)]
    sampler = Sampler(1000, seed=0)
    assert sampler.sample(logits, rows).next_tokens == sampler.sample(logits, same).next_tokens


# --- the sampling distribution --------------------------------------------------------------------

LOGITS8 = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.25])


@pytest.mark.parametrize("seeded", [False, True])
def test_temperature_distribution_matches_softmax(seeded: bool) -> None:
    n, temperature = 20000, 0.7
    sampler = Sampler(8, seed=123)
    logits = LOGITS8.unsqueeze(0).expand(n, -1).contiguous()
    rows = [row(temperature=temperature, seed=i if seeded else None) for i in range(n)]
    counts = torch.bincount(torch.tensor(sampler.sample(logits, rows).next_tokens), minlength=8)
    probs = torch.softmax(LOGITS8.double() / temperature, dim=-1)
    assert chi_square(counts, probs) < CHI2_999[7]


def test_top_k_and_top_p_renormalise_over_the_kept_tokens() -> None:
    sampler = Sampler(8, seed=5)
    probs = torch.softmax(LOGITS8.double(), dim=-1)
    # top_k=3 keeps tokens 0, 6, 1; df = 2.
    counts = draw_counts(sampler, LOGITS8, 20000, top_k=3)
    kept = torch.tensor([0, 6, 1])
    assert counts.sum() == counts[kept].sum()
    assert chi_square(counts[kept], probs[kept] / probs[kept].sum()) < CHI2_999[2]
    # top_p=0.8: sorted masses 0.379, 0.230, 0.139, 0.085 reach 0.8 at the 4th token; df = 3.
    order = torch.argsort(LOGITS8, descending=True)
    assert probs[order[:3]].sum() < 0.8 <= probs[order[:4]].sum()
    counts = draw_counts(sampler, LOGITS8, 20000, top_p=0.8)
    kept = order[:4]
    assert counts.sum() == counts[kept].sum()
    assert chi_square(counts[kept], probs[kept] / probs[kept].sum()) < CHI2_999[3]


def _expected_support(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """The definitions, in float64 and plain Python."""
    order = sorted(range(logits.numel()), key=lambda i: -float(logits[i]))
    kept = order[:top_k] if top_k > 0 else order
    weights = {i: math.exp(float(logits[i])) for i in kept}
    total = sum(weights.values())
    mass, nucleus = 0.0, []
    for i in kept:
        if mass >= top_p:
            break
        nucleus.append(i)
        mass += weights[i] / total
    best = max(weights[i] for i in nucleus)
    return {i for i in nucleus if weights[i] >= min_p * best}


@pytest.mark.parametrize(("top_k", "top_p", "min_p"), [
    (5, 1.0, 0.0), (0, 0.6, 0.0), (0, 1.0, 0.2), (12, 0.9, 0.05), (-1, 0.3, 0.5),
])
def test_filters_keep_exactly_the_right_support(top_k: int, top_p: float, min_p: float) -> None:
    torch.manual_seed(6)
    logits = torch.randn(40) * 2
    want = _expected_support(logits, top_k, top_p, min_p)
    values, ids = logits.sort(descending=True)
    keep, _ = keep_mask_sorted(
        values.unsqueeze(0),
        torch.tensor([top_k if top_k > 0 else 40]),
        torch.tensor([top_p]),
        torch.tensor([min_p]),
        torch.logsumexp(values[: top_k if top_k > 0 else 40], dim=0).unsqueeze(0),
    )
    assert set(ids[keep[0]].tolist()) == want
    # And the sampler never leaves that support (a flat temperature spreads the draws over it).
    counts = draw_counts(Sampler(40, seed=8), logits, 4000, top_k=top_k, top_p=top_p,
                         min_p=min_p)
    drawn = set(counts.nonzero().flatten().tolist())
    assert drawn <= want
    assert len(drawn) >= min(len(want), 3)


# --- penalties, bias, min_new_tokens -------------------------------------------------------------

def test_penalty_formulas_on_a_hand_made_tensor() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 4.0],
                           [2.0, -1.0, 0.5, -3.0, 4.0]])
    counts = torch.tensor([[2.0, 1.0, 0.0, 0.0, 0.0],
                           [0.0, 0.0, 3.0, 0.0, 0.0]])
    prompt = torch.tensor([[False, False, False, True, False],
                           [True, False, False, False, False]])
    out = apply_penalties(
        logits.clone(), TokenStats(counts, prompt),
        repetition=torch.tensor([2.0, 1.0]),
        frequency=torch.tensor([0.5, 0.25]),
        presence=torch.tensor([1.0, -0.5]),
    )
    want = torch.tensor([
        # token 0: seen, >0 -> 2/2, then -0.5*2 freq, -1 presence; token 1: -1*2 -0.5 -1;
        # token 3: prompt only -> -3*2, no output penalties; tokens 2, 4 untouched.
        [2.0 / 2 - 0.5 * 2 - 1.0, -1.0 * 2 - 0.5 * 1 - 1.0, 0.5, -3.0 * 2, 4.0],
        # repetition 1 (off); token 2: -0.25*3 + 0.5 presence.
        [2.0, -1.0, 0.5 - 0.25 * 3 + 0.5, -3.0, 4.0],
    ])
    torch.testing.assert_close(out, want)


def test_penalties_through_the_sampler() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]]).repeat(3, 1)
    rows = [
        row(temperature=0.0, repetition_penalty=1.2, prompt_ids=[0]),  # 3/1.2 = 2.5 < 2.9
        row(temperature=0.0, frequency_penalty=0.06, output_ids=[0, 0]),  # 3 - 0.12 < 2.9
        row(temperature=0.0, presence_penalty=0.05, output_ids=[0, 0]),  # 3 - 0.05 > 2.9
    ]
    assert Sampler(4).sample(logits, rows).next_tokens == [1, 1, 0]


def test_logit_bias_forces_a_token() -> None:
    torch.manual_seed(9)
    logits = torch.randn(64, 300) * 3
    rows = [row(temperature=1.0, logit_bias={123: 100.0}, seed=i) for i in range(64)]
    assert Sampler(300, seed=0).sample(logits, rows).next_tokens == [123] * 64


def test_allowed_token_ids_ban_every_other_token() -> None:
    torch.manual_seed(4)
    logits = torch.randn(4, 50) * 3
    allowed = [7, 31, 12]
    best = max(allowed, key=lambda t: float(logits[0, t]))
    assert int(logits[0].argmax()) not in allowed  # (so that the list has work to do)
    rows = [row(temperature=0.0, allowed_token_ids=allowed),
            row(temperature=0.0),  # a row without the list: untouched beside it
            row(temperature=1.0, allowed_token_ids=[3], logit_bias={9: 100.0}),
            row(temperature=0.0, allowed_token_ids=allowed, logit_bias={31: -100.0},
                logprobs=2)]
    result = Sampler(50, seed=0).sample(logits, rows)
    assert result.next_tokens[:3] == [best, int(logits[1].argmax()), 3]
    assert result.next_tokens[3] == max((7, 12), key=lambda t: float(logits[3, t]))
    sampled = [Sampler(50, seed=s).sample(logits[:1], [row(temperature=2.0, top_k=40,
                                                             allowed_token_ids=allowed)])
               for s in range(40)]
    assert {r.next_tokens[0] for r in sampled} <= set(allowed)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[]).validate(50)
    with pytest.raises(ValueError, match="token id 50"):
        SamplingParams(allowed_token_ids=[1, 50]).validate(50)
    assert not SamplingParams(temperature=0.0, allowed_token_ids=[1]).plain_greedy


def test_bad_words_ban_their_last_token_after_the_rest() -> None:
    logits = torch.zeros(4, 10)
    logits[:, 6] = 5.0  # the favourite everywhere
    logits[:, 2] = 4.0
    words = [[6], [1, 2]]
    rows = [row(temperature=0.0, bad_words_ids=[[6]]),  # one token: banned always
            row(temperature=0.0, bad_words_ids=words, output_ids=[3, 1]),  # 1 then 2: banned
            row(temperature=0.0, bad_words_ids=[[1, 2]], output_ids=[1, 3]),  # not after 1
            row(temperature=0.0, bad_words_ids=[[4, 1, 6]], output_ids=[4, 1])]
    assert Sampler(10).sample(logits, rows).next_tokens == [2, int(logits[1, :2].argmax()),
                                                            6, 2]


def test_bans_that_leave_nothing_fall_back_to_the_grammar_and_model() -> None:
    """A row whose own bans ban every token (allowed tokens all banned by bad words or
    min_tokens) gets the model's own choice that step, never a token picked among -inf."""
    torch.manual_seed(2)
    logits = torch.randn(3, 12)
    assert int(logits[0].argmax()) not in (0, 4)  # (what a row of -inf would give, the ban)
    rows = [row(temperature=0.0, allowed_token_ids=[4], bad_words_ids=[[4]]),
            row(temperature=1.0, allowed_token_ids=[7], min_new_tokens=2, stop_token_ids=[7]),
            row(temperature=0.0, allowed_token_ids=[5, 9])]
    tokens = Sampler(12, seed=1).sample(logits, rows).next_tokens
    assert tokens[0] == int(logits[0].argmax())
    assert 0 <= tokens[1] < 12 and bool(torch.isfinite(logits[1, tokens[1]]))
    assert tokens[2] == max((5, 9), key=lambda t: float(logits[2, t]))


def test_min_new_tokens_blocks_stop_tokens() -> None:
    eos, stop = 7, 5
    logits = torch.zeros(6, 10)
    logits[:, eos] = 50.0
    logits[:, stop] = 40.0
    rows = [
        row(temperature=0.0, min_new_tokens=3, output_ids=[1, 2]),  # under: eos banned
        row(temperature=1.0, min_new_tokens=3, output_ids=[1, 2], stop_token_ids=[stop]),
        row(temperature=0.0, min_new_tokens=3, output_ids=[1, 2, 3]),  # reached: eos allowed
        row(temperature=0.0, min_new_tokens=3, ignore_eos=True),  # ignore_eos: eos not a stop
        row(temperature=0.0, min_new_tokens=3, ignore_eos=True, stop_token_ids=[eos]),
        row(temperature=0.0),
    ]
    tokens = Sampler(10, seed=0, eos_token_ids={eos}).sample(logits, rows).next_tokens
    assert tokens[0] == stop
    assert tokens[1] not in (eos, stop)
    assert tokens[2:] == [eos, eos, stop, eos]
    # The per-call EOS set replaces the constructor's.
    assert Sampler(10).sample(logits[:1], rows[:1], eos_token_ids=[eos]).next_tokens == [stop]


# --- logprobs -------------------------------------------------------------------------------------

def test_logprobs_are_raw_log_softmax_with_sorted_top_k() -> None:
    torch.manual_seed(10)
    logits = torch.randn(4, 30)
    rows = [row(temperature=0.7, logprobs=5, repetition_penalty=1.5, prompt_ids=[1, 2]),
            row(temperature=0.0, logprobs=0),
            row(temperature=1.0),
            row(temperature=0.0, logprobs=3, logit_bias={4: 9.0})]
    result = Sampler(30, seed=0).sample(logits, rows)
    reference = torch.log_softmax(logits, dim=-1)
    assert result.logprobs[2] is None
    for i, k in [(0, 5), (1, 0), (3, 3)]:
        entry = result.logprobs[i]
        assert entry is not None and entry.token_id == result.next_tokens[i]
        assert entry.logprob == pytest.approx(float(reference[i, entry.token_id]), abs=1e-6)
        assert len(entry.top_ids) == len(entry.top_logprobs) == k
        assert entry.top_logprobs == sorted(entry.top_logprobs, reverse=True)
        want_vals, want_ids = reference[i].topk(k) if k else (torch.empty(0), torch.empty(0))
        assert entry.top_ids == want_ids.tolist()
        assert entry.top_logprobs == pytest.approx(want_vals.tolist(), abs=1e-6)
    assert result.next_tokens[3] == 4  # the bias steered the choice, not the logprobs


# --- CUDA -----------------------------------------------------------------------------------------

@pytest.mark.cuda
def test_cuda_seeded_rows_are_batch_independent() -> None:
    target = torch.randn(500, device="cuda")
    sampler = Sampler(500, device="cuda", seed=0)
    a = _cuda_generate(sampler, target, 0, 1)
    b = _cuda_generate(sampler, target, 3, 7)
    assert a == b


def _cuda_generate(sampler: Sampler, target: torch.Tensor, position: int, batch: int) -> list[int]:
    out: list[int] = []
    for _ in range(6):
        logits = torch.randn(batch, target.numel(), device="cuda")
        logits[position] = target
        rows = [row() for _ in range(batch)]
        rows[position] = row(output_ids=list(out), seed=11, top_p=0.95)
        out.append(sampler.sample(logits, rows).next_tokens[position])
    return out


def test_top_candidates_shortcut_draws_the_same_tokens_as_a_full_sort() -> None:
    """On the CPU, top-k/top-p rows first look at the top `top_candidates` tokens and fall back to
    a full sort when their support may reach past them; the token must not depend on the path."""
    torch.manual_seed(12)
    vocab = 300
    params = [dict(top_p=0.95), dict(top_p=0.3), dict(top_k=10), dict(top_k=100),
              dict(top_k=100, top_p=0.5), dict(top_p=0.9, min_p=0.05), dict(min_p=0.1), dict()]
    rows = [row(seed=100 + i, temperature=0.9, **p) for i, p in enumerate(params * 8)]
    logits = torch.randn(len(rows), vocab) * torch.linspace(0.5, 4.0, len(rows)).unsqueeze(1)
    full, shortcut = Sampler(vocab), Sampler(vocab)
    full.top_candidates, shortcut.top_candidates = None, 16
    assert full.sample(logits, rows).next_tokens == shortcut.sample(logits, rows).next_tokens
    # Equal logits (untrained tokens often have them) are taken in one order on every path:
    # here each row's five most likely tokens tie.
    top = logits.max(dim=1, keepdim=True).values + 1.0
    tied = logits.index_fill(1, torch.tensor([7, 70, 140, 200, 299]), 0.0) + \
        torch.zeros_like(logits).index_fill(1, torch.tensor([7, 70, 140, 200, 299]), 1.0) * top
    drawn = full.sample(tied, rows).next_tokens
    assert drawn == shortcut.sample(tied, rows).next_tokens
    assert len(set(drawn) & {7, 70, 140, 200, 299}) >= 3  # (the ties were drawn from)


def test_top_candidates_order_and_middle_tier() -> None:
    """top_candidates answers what a full stable sort's first k are (ties by id), through the
    partition (k >= 128) and through topk (small k); rows whose nucleus passes the candidates
    are drawn from 8x as many before a full sort, with the same tokens."""
    from banyan.sampling.filters import sort_descending, top_candidates

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 5000, generator=gen)
    x[:, 10:20] = 9.0  # ties inside the candidates
    for k in (16, 200, 1024):
        values, ids = top_candidates(x, k)
        full_values, full_ids = sort_descending(x)
        assert torch.equal(values, full_values[:, :k]) and torch.equal(ids, full_ids[:, :k])
    flat = torch.randn(16, 5000, generator=gen) * 0.05  # nuclei of thousands of tokens
    rows = [row(seed=7 + i, temperature=1.0, top_p=p) for i, p in enumerate([0.05, 0.3] * 8)]
    full, shortcut = Sampler(5000), Sampler(5000)
    full.top_candidates, shortcut.top_candidates = None, 64  # 64, then 512, then all
    assert full.sample(flat, rows).next_tokens == shortcut.sample(flat, rows).next_tokens


def test_argmax_rows_is_torch_argmax() -> None:
    """The numpy greedy path picks what torch.argmax picks: the first maximum of each row, on
    strided (vocabulary-trimmed) views and every float dtype numpy takes."""
    from banyan.sampling.greedy import argmax_rows

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 1000, generator=gen)
    x[3, 10] = x[3, 900] = 50.0  # a tie: the first wins
    x[5, :] = 1.0  # a row of ties
    for view in (x, x[:, :999], x[::2], x.double(), x.half(), x.bfloat16()):
        got = argmax_rows(view)
        assert got.dtype == torch.int64 and torch.equal(got, view.argmax(dim=-1))
    assert argmax_rows(x)[3] == 10 and argmax_rows(x)[5] == 0
