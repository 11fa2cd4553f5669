"""Draft verification in the sampler (pagedgen.sampling.draft_verification): acceptance, exact
distribution, streams."""

from __future__ import annotations

import pytest
import torch

from pagedgen.errors import RowSamplingError
from pagedgen.sampling import RequestSampler, Sampler, SampleRow, SamplingOptions
from pagedgen.sampling.draft_verification import sample_with_drafts

VOCAB = 6


def row(seed: int | None = None, **options) -> SampleRow:
    sampler = RequestSampler(SamplingOptions(seed=seed, **options))
    return SampleRow(sampler, [1, 2], 2, [], 0, ())


def greedy_logits(tokens: list[int]) -> torch.Tensor:
    logits = torch.zeros(len(tokens), VOCAB)  # [K+1, V]
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


@pytest.mark.parametrize("drafts, accepted", [([3, 4, 5], 3), ([3, 4, 0], 2), ([0, 4, 5], 0), ([], 0)])
def test_greedy_accepts_the_longest_matching_prefix_then_the_next_row(drafts, accepted):
    targets = [3, 4, 5, 1][: len(drafts) + 1]
    (verified,) = sample_with_drafts(Sampler(), greedy_logits(targets), [row()], [drafts])
    assert [t.token for t in verified.outputs] == targets[: accepted + 1]
    assert (verified.num_drafts, verified.num_accepted) == (len(drafts), accepted)


def test_rows_of_several_requests_are_split_in_order():
    logits = greedy_logits([3, 4, 2, 5])  # request 0: one row; request 1: three rows
    a, b = sample_with_drafts(Sampler(), logits, [row(), row()], [[], [4, 1]])
    assert [t.token for t in a.outputs] == [3] and [t.token for t in b.outputs] == [4, 2]
    assert b.num_accepted == 1


def test_sampled_rows_match_sampling_without_drafts_and_advance_per_token():
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5, -1.0, 0.0]] * 3)  # the same distribution in every row
    for seed in range(50):
        plain = row(seed, do_sample=True, temperature=1.0)
        alone = Sampler().sample(logits[:1], [plain])[0].token
        drafted = row(seed, do_sample=True, temperature=1.0)
        (verified,) = sample_with_drafts(Sampler(), logits, [drafted], [[alone, 2]])
        assert verified.outputs[0].token == alone and verified.num_accepted >= 1
        assert drafted.sampler.draws == len(verified.outputs)


def test_sampled_acceptance_is_the_rejection_samplers_and_the_output_is_exact():
    """Acceptance of draft d happens with probability p(d) = min(1, p(d)/q(d)) for a point mass q, and
    after a rejection the token follows p without d; so the first token is distributed as p."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5, -1.0, 0.0], [0.3, 0.0, 0.0, 2.0, 0.0, 0.0]])
    p = torch.softmax(logits[0], dim=-1)
    draft = 1
    n = 3000
    first = torch.zeros(VOCAB)
    accepted = 0
    for seed in range(n):
        (verified,) = sample_with_drafts(
            Sampler(), logits, [row(seed, do_sample=True, temperature=1.0)], [[draft]]
        )
        first[verified.outputs[0].token] += 1
        accepted += verified.num_accepted
    freq = first / n
    assert abs(accepted / n - float(p[draft])) < 0.03
    assert torch.allclose(freq, p, atol=0.03)
    chi2 = float((((first - n * p) ** 2) / (n * p)).sum())
    assert chi2 < 25.0  # 5 degrees of freedom: p-value far below 1e-3 beyond this


def test_an_unsampleable_draft_row_names_its_request_and_changes_no_stream():
    logits = torch.zeros(3, VOCAB)
    logits[2] = float("nan")
    a, b = row(1, do_sample=True), row(2, do_sample=True)
    with pytest.raises(RowSamplingError) as raised:
        sample_with_drafts(Sampler(), logits, [a, b], [[], [0]])
    assert raised.value.row == 1
    assert a.sampler.draws == b.sampler.draws == 0
