"""Logprobs come from the processed distribution the token was drawn from."""

from __future__ import annotations

import math

import pytest
import torch

from pagedgen.errors import RowSamplingError
from pagedgen.sampling import RequestSampler, Sampler, SampleRow, SamplingOptions

VOCAB = 40


def _row(options: SamplingOptions, n: int, tokens: list[int] | None = None) -> SampleRow:
    tokens = tokens if tokens is not None else [1, 2, 3]
    return SampleRow(RequestSampler(options), tokens, len(tokens), [], 0, (0,), n)


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2  # [R, V]


@pytest.mark.parametrize("seed", range(3))
def test_sampled_rows_logprobs_are_the_processed_distribution(seed: int) -> None:
    options = [
        SamplingOptions(do_sample=True, seed=seed, temperature=0.5),
        SamplingOptions(do_sample=True, seed=seed, top_k=3),
        SamplingOptions(do_sample=True, seed=seed, temperature=1.3, top_p=0.8),
        SamplingOptions(do_sample=True, seed=seed),
    ]
    ns = [5, 5, 40, 1]
    logits = _logits(4, seed)
    out = Sampler().sample(logits, [_row(o, n) for o, n in zip(options, ns, strict=True)])
    expected_dist = [
        torch.log_softmax(logits[0] / 0.5, -1),
        torch.log_softmax(logits[1].masked_fill(logits[1] < logits[1].topk(3).values[-1], -math.inf), -1),
    ]
    for r, s in enumerate(out):
        assert s.logprob is not None and s.logprob <= 0.0 and math.isfinite(s.logprob)
        values = [v for _, v in s.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert all(v <= 0.0 and math.isfinite(v) for v in values)
        assert math.log(sum(math.exp(v) for v in values)) <= 1e-6  # top-n mass is at most 1
        if s.token in dict(s.top_logprobs):
            assert dict(s.top_logprobs)[s.token] == s.logprob
        if r < len(expected_dist):
            assert s.logprob == pytest.approx(float(expected_dist[r][s.token]), abs=1e-5)
    assert len(out[0].top_logprobs) == 5
    assert len(out[1].top_logprobs) == 3  # filtered tokens (probability 0) are not alternatives
    assert math.isclose(sum(math.exp(v) for _, v in out[1].top_logprobs), 1.0, rel_tol=1e-5)
    top_p_kept = len(out[2].top_logprobs)
    assert 1 <= top_p_kept < VOCAB
    assert out[2].token in dict(out[2].top_logprobs)  # all kept tokens listed: the sampled one among them
    assert len(out[3].top_logprobs) == 1


def test_greedy_token_has_the_max_logprob_and_rows_without_n_get_none() -> None:
    logits = _logits(3, seed=5)
    rows = [
        _row(SamplingOptions(), 3),
        _row(SamplingOptions(repetition_penalty=1.5), 2, tokens=[int(logits[1].argmax())]),
        _row(SamplingOptions(), 0),
    ]
    out = Sampler().sample(logits, rows)
    for s in out[:2]:
        assert s.top_logprobs[0] == (s.token, s.logprob)
        assert s.logprob == max(v for _, v in s.top_logprobs)
    assert out[0].token == int(logits[0].argmax())
    assert out[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1).max()), abs=1e-6)
    assert out[1].token != int(logits[1].argmax())  # the penalty moved the argmax; logprobs follow it
    assert out[2].logprob is None and out[2].top_logprobs == ()


def test_a_bad_sampled_row_with_logprobs_is_refused_before_any_stream_advances() -> None:
    """A row with no sampleable token draws an index past the vocab; its logprob gather must stay in range
    so the call reaches its refusal (from the one host copy) instead of failing in the gather."""
    good = _row(SamplingOptions(do_sample=True, seed=1), 2)
    logits = _logits(2, seed=7)
    logits[1] = -float("inf")
    with pytest.raises(RowSamplingError) as raised:
        Sampler().sample(logits, [good, _row(SamplingOptions(do_sample=True, seed=2), 3)])
    assert raised.value.row == 1 and good.sampler.draws == 0
