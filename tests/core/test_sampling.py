"""The sampler (issue 11 §3): each filter and penalty against a numpy reference written here, by
exact counts (a grid of uniform numbers through the inverse-CDF draw gives each token its
probability × N draws, ±1), edge cases, raw logprobs, seeds, non-finite rows, refused params."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import _core
from pagedkv.errors import InvalidArgumentError
from pagedkv.sampling import MAX_LOGIT_BIAS_TOKENS, NO_TOKEN, SamplingParams, TokenHistory, sample, sample_with_logprobs


class Fixed:
    """A generator whose one draw is ``u``: lets a test walk the draw's uniform number."""

    def __init__(self, u: float) -> None:
        self.u = u

    def random(self) -> float:
        return self.u


def reference(logits: np.ndarray, p: SamplingParams, history: TokenHistory | None = None) -> np.ndarray:
    """The probabilities the module doc defines, in float64 with full sorts."""
    x = logits.astype(np.float64).copy()
    if history is not None:
        for token, count in zip(history.tokens.tolist(), history.counts.tolist(), strict=True):
            x[token] = x[token] / p.repetition_penalty if x[token] > 0 else x[token] * p.repetition_penalty
            x[token] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    vocab = len(x)
    if p.temperature == 0:
        return np.eye(vocab)[np.argmax(x)]
    x = x / p.temperature
    keep = np.ones(vocab, dtype=bool)
    if 0 < p.top_k < vocab:
        keep &= x >= np.sort(x)[::-1][p.top_k - 1]
    full = np.exp(x - x.max())
    keep &= full >= p.min_p * full.max()
    q = np.where(keep, full, 0.0)
    q /= q.sum()
    if p.top_p < 1:
        order = np.lexsort((np.arange(vocab), -q))
        before = np.cumsum(q[order]) - q[order]
        q[order[before >= p.top_p]] = 0.0
        q /= q.sum()
    return q


def counts(logits: np.ndarray, p: SamplingParams, draws: int, history: TokenHistory | None = None) -> np.ndarray:
    rows = np.tile(logits.astype(np.float32), (draws, 1))
    gens = [Fixed((j + 0.5) / draws) for j in range(draws)]
    tokens = sample(rows, [p] * draws, gens, [history] * draws)
    return np.bincount(tokens, minlength=len(logits))


SMALL = np.array([1.0, 2.5, 0.3, 2.5, -1.0, 0.9, 1.7, -3.0, 2.2, 0.0], dtype=np.float32)
FILTERS = [
    dict(temperature=1.0),
    dict(temperature=0.6),
    dict(temperature=1.3, top_k=3),
    dict(temperature=1.0, top_k=2),  # ties at the 2nd: both 2.5s, and nothing else
    dict(temperature=0.8, top_p=0.7),
    dict(temperature=0.8, min_p=0.3),
    dict(temperature=0.8, top_k=5, top_p=0.8, min_p=0.1),
    dict(temperature=1.0, top_k=10),  # top_k = vocab: no cut
    dict(temperature=1.0, top_k=50),  # top_k > vocab
    dict(temperature=1.0, top_p=1.0, min_p=0.0),
    dict(temperature=0.0, top_k=3, top_p=0.5),  # greedy ignores the filters: first maximum
]


@pytest.mark.parametrize("kwargs", FILTERS, ids=[str(f) for f in FILTERS])
def test_each_filter_gives_the_reference_probabilities(kwargs):
    p = SamplingParams(**kwargs)
    draws = 4000
    expected = reference(SMALL, p) * draws
    got = counts(SMALL, p, draws)
    assert np.all(np.abs(got - expected) <= 1.01), (got, expected.round(1))


@pytest.mark.parametrize("kwargs", [dict(temperature=0.9), dict(temperature=0.9, top_p=0.9), dict(temperature=0.7, top_k=40),
                                    dict(temperature=0.7, min_p=0.2), dict(temperature=0.7, top_k=200, top_p=0.95, min_p=0.01)])
def test_filters_at_a_large_vocabulary(kwargs):
    """8,192 tokens: the kernel's sampled k-th guess, its histogram top-p and its dense draw."""
    logits = np.random.default_rng(3).standard_normal(8192).astype(np.float32) * 2.0
    p = SamplingParams(**kwargs)
    draws = 3000
    expected = reference(logits, p) * draws
    got = counts(logits, p, draws)
    assert np.all(np.abs(got - expected) <= 1.01)
    assert got.sum() == draws


def test_penalties_follow_openai_and_hf_formulas():
    history = TokenHistory([1, 1, 4, 6], with_prompt=True)
    for token in [3, 3, 8, 1]:
        history.append(token)
    assert dict(zip(history.tokens.tolist(), history.counts.tolist(), strict=True)) == {1: 1, 4: 0, 6: 0, 3: 2, 8: 1}
    for kwargs in [dict(repetition_penalty=1.8), dict(presence_penalty=1.5), dict(frequency_penalty=0.7),
                   dict(repetition_penalty=0.6, presence_penalty=-1.0, frequency_penalty=2.0)]:
        p = SamplingParams(temperature=1.0, **kwargs)
        draws = 4000
        expected = reference(SMALL, p, history) * draws
        assert np.all(np.abs(counts(SMALL, p, draws, history) - expected) <= 1.01), kwargs
    greedy = SamplingParams(temperature=0.0, frequency_penalty=2.0)  # 1 and 3 fall to 0.5 and -1.5: 6 leads
    assert sample(SMALL[None], [greedy], [None], [history]).tolist() == [6]
    assert sample(SMALL[None], [greedy], [None]).tolist() == [1]  # no history: no penalty


def test_logprobs_are_the_raw_log_softmax_with_top_n():
    rows = np.stack([SMALL, SMALL[::-1] * 3]).astype(np.float32)
    p = SamplingParams(temperature=0.7, top_k=3, repetition_penalty=2.0, logprobs=True, top_logprobs=4)
    history = TokenHistory([1, 3])
    out = sample_with_logprobs(rows, [p, p], [np.random.default_rng(0), np.random.default_rng(1)], [history, None])
    log_softmax = rows - np.log(np.exp(rows - rows.max(1, keepdims=True)).sum(1, keepdims=True)) - rows.max(1, keepdims=True)
    for r in range(2):
        assert out.logprobs[r] == pytest.approx(log_softmax[r, out.tokens[r]], abs=1e-5)
        order = np.lexsort((np.arange(10), -log_softmax[r]))[:4]
        assert out.top_ids[r].tolist() == order.tolist()
        np.testing.assert_allclose(out.top_logprobs[r], log_softmax[r, order], atol=1e-5)
    mixed = sample_with_logprobs(rows, [p, SamplingParams()], [np.random.default_rng(0)] * 2)
    assert np.isnan(mixed.logprobs[1]) and mixed.top_ids[1].tolist() == [-1] * 4


def test_seeds_reproduce_whatever_shares_the_batch():
    logits = np.random.default_rng(5).standard_normal((3, 5000)).astype(np.float32)
    p = SamplingParams(temperature=0.9, top_p=0.9, seed=7)
    others = [SamplingParams(temperature=1.2, seed=s) for s in (1, 2)]
    alone = [sample(logits[:1], [p], [g]).item() for g in [p.make_generator(0)] for _ in range(1)]
    gen = p.make_generator(0)
    first = [sample(logits[:1], [p], [gen]).item() for _ in range(20)]
    gen = p.make_generator(0)
    shared = [sample(logits, [p, *others], [gen, *(o.make_generator() for o in others)])[0].item() for _ in range(20)]
    assert first == shared and first[0] == alone[0]
    assert len(set(first)) > 1  # the stream moves on


@pytest.mark.parametrize("row", [[0.0, np.nan, 1.0], [-np.inf] * 3])
def test_non_finite_rows_still_give_no_token(row):
    p = SamplingParams(temperature=0.8, top_k=2, presence_penalty=1.0, logprobs=True, top_logprobs=2)
    out = sample_with_logprobs(np.array([row], np.float32), [p], [np.random.default_rng(0)], [TokenHistory([0])])
    assert out.tokens.tolist() == [NO_TOKEN] and np.isnan(out.logprobs[0])


@pytest.mark.parametrize("kwargs", [dict(min_p=-0.1), dict(min_p=1.5), dict(min_p="0.1"), dict(presence_penalty=2.5),
                                    dict(frequency_penalty=-3), dict(frequency_penalty=np.nan), dict(repetition_penalty=0),
                                    dict(repetition_penalty=-1.0), dict(logprobs=1), dict(top_logprobs=3),
                                    dict(logprobs=True, top_logprobs=21), dict(logprobs=True, top_logprobs=-1),
                                    dict(temperature=np.inf), dict(top_p=0.0), dict(top_k=-1), dict(top_k=1.5),
                                    # issue 23 item 1: ints a float64 cannot hold (OverflowError, or rounded)
                                    dict(temperature=10**400), dict(top_p=-10**400), dict(min_p=10**309),
                                    dict(presence_penalty=10**400), dict(frequency_penalty=-10**400),
                                    dict(repetition_penalty=10**400), dict(temperature=2**53 + 1),
                                    dict(repetition_penalty=np.uint64(2**64 - 1))])
def test_bad_params_are_refused_typed(kwargs):
    with pytest.raises(InvalidArgumentError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("top_k", [2**32 - 1, 2**32, 10**30])
def test_a_top_k_past_the_vocabulary_keeps_all(top_k):
    """Issue 23 item 1: any k ≥ the vocabulary draws exactly as 0 (keep all); the kernel, which
    takes k below 2**32, never sees it."""
    rows = np.tile(SMALL, (50, 1))
    grid = [Fixed((j + 0.5) / 50) for j in range(50)]
    want = sample_with_logprobs(rows, [SamplingParams(temperature=0.9)] * 50, grid)
    got = sample_with_logprobs(rows, [SamplingParams(temperature=0.9, top_k=top_k)] * 50, grid)
    assert got.tokens.tolist() == want.tokens.tolist()
    assert not got.refused


def test_a_row_the_kernel_refuses_fails_alone(monkeypatch):
    """Issue 23 item 1, defence in depth: a batch the kernel refuses is sampled row by row; the
    refused row gets no token and its reason, the others what they draw alone (their one uniform
    number each, not a second)."""
    real = _core.sample_rows

    def refusing(logits, table, *rest):
        if (table[:, 0] == 0.625).any():  # the marked row's temperature
            raise InvalidArgumentError("top_k must be a non-negative integer, got 1e30")
        return real(logits, table, *rest)

    monkeypatch.setattr(_core, "sample_rows", refusing)
    params = [SamplingParams(temperature=0.9, logprobs=True, top_logprobs=2), SamplingParams(temperature=0.625),
              SamplingParams(temperature=0.0, logprobs=True)]
    rows = np.tile(SMALL, (3, 1))
    out = sample_with_logprobs(rows, params, [Fixed(0.3), Fixed(0.3), Fixed(0.3)])
    assert out.refused == {1: "top_k must be a non-negative integer, got 1e30"}
    assert out.tokens[1] == NO_TOKEN and np.isnan(out.logprobs[1])
    alone = [sample_with_logprobs(rows[:1], [params[r]], [Fixed(0.3)]) for r in (0, 2)]
    assert out.tokens[[0, 2]].tolist() == [a.tokens[0] for a in alone]
    assert out.logprobs[[0, 2]].tolist() == [a.logprobs[0] for a in alone]
    assert out.top_ids[0].tolist() == alone[0].top_ids[0].tolist() and out.top_ids.shape == (3, 2)


def test_logit_bias_is_checked_sorted_and_applied_after_the_penalties():
    params = SamplingParams(temperature=0.0, logit_bias={5: 2.0, 1: -100, 3: 0.5})
    assert params.logit_bias == ((1, -100.0), (3, 0.5), (5, 2.0))
    assert hash(params) == hash(SamplingParams(temperature=0.0, logit_bias=[(3, 0.5), (5, 2.0), (1, -100)]))
    for bad in ({1: 100.5}, {-1: 1.0}, {True: 1.0}, {1: float("nan")}, {"1": 1.0}, {1: True}, 5,
                {i: 1.0 for i in range(MAX_LOGIT_BIAS_TOKENS + 1)}):
        with pytest.raises(InvalidArgumentError, match="logit_bias"):
            SamplingParams(logit_bias=bad)  # type: ignore[arg-type]
    logits = np.array([[0.0, 3.0, 1.0, 0.0, 0.0, 2.5]], dtype=np.float32)
    history = TokenHistory([5])  # repetition penalty 2 halves token 5's logit first: 1.25, then + 2.0
    penalized = SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias={5: 2.0, 1: -100})
    out = sample_with_logprobs(logits, [penalized], [np.random.default_rng(0)], [history])
    assert out.tokens.tolist() == [5]
    assert sample(logits, [SamplingParams(temperature=0.0)], [np.random.default_rng(0)]).tolist() == [1]
