"""The prompt-lookup proposer and the draft driver above the engine (pagedgen.spec), and pg.LLM with them."""

from __future__ import annotations

import pytest

import pagedgen as pg
from pagedgen.models.synthetic import SyntheticModel, synthetic_greedy
from pagedgen.spec import DraftDriver, NgramProposer


def test_proposes_what_followed_the_latest_match_of_the_longest_suffix():
    proposer = NgramProposer(num_speculative_tokens=3, max_ngram=3, min_ngram=1)
    #            0  1  2  3  4  5  6  7  8  9 10
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 1, 2, 3]
    assert proposer.propose(tokens) == [4, 5, 9]  # "1 2 3" (3-gram) beats the later "2 3" (2-gram)
    assert proposer.propose([5, 6, 7, 8, 5, 6, 9, 8, 5, 6]) == [9, 8, 5]  # "8 5 6" at 3
    assert proposer.propose([5, 6, 1, 2, 3, 5, 6, 4, 5, 6]) == [4, 5, 6]  # the latest "5 6" with 3 after it
    assert proposer.propose([5, 6, 1, 2, 5, 6, 5, 6]) == [1, 2, 5]  # the later "5 6" has only 2 after it
    assert proposer.propose([1, 5, 6, 5, 6]) == [5, 6]  # no match has 3 after it: the earliest
    assert proposer.propose([1, 2, 3, 4]) == []
    assert proposer.propose([7]) == []
    assert proposer.propose([4, 4, 4, 4]) == [4]  # a run: the continuation may overlap the suffix


def test_min_ngram_and_lookback_bound_the_search():
    assert NgramProposer(3, max_ngram=3, min_ngram=2).propose([1, 5, 2, 1]) == []
    tokens = [1, 2, 8, 9] + [0] * 20 + [1, 2]
    assert NgramProposer(2, 2, 2, lookback=30).propose(tokens) == [8, 9]
    assert NgramProposer(2, 2, 2, lookback=10).propose(tokens) == []


@pytest.mark.parametrize(
    "kwargs",
    [{"num_speculative_tokens": 0}, {"max_ngram": 0}, {"min_ngram": 3, "max_ngram": 2}, {"lookback": True}],
)
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="NgramProposer"):
        NgramProposer(**kwargs)


class FakeRequest:
    """What the driver reads and calls on a request."""

    def __init__(self, rid: int):
        self.id = rid
        self.ready_for_drafts = True
        self.draft_tokens: tuple[int, ...] = ()
        self.drafts_proposed = 0
        self.drafts_accepted = 0
        self.tokens = (1, 2, 3, 1, 2)
        self.proposals: list[list[int]] = []

    def set_draft_tokens(self, drafts):
        self.proposals.append(list(drafts))


class FakeEngine:
    def max_draft_tokens_per_proposal(self) -> int:
        return 2


def test_driver_backs_off_after_rejected_proposals_and_resets_on_acceptance():
    driver = DraftDriver(FakeEngine(), NgramProposer(4, 2, 1), max_backoff=4)
    request = FakeRequest(1)
    chances = []
    for step in range(12):
        before = len(request.proposals)
        driver.propose([request])
        proposed = len(request.proposals) > before
        chances.append(proposed)
        if proposed:
            request.drafts_proposed += 2
            request.drafts_accepted += 2 if step >= 8 else 0  # rejected until step 8
    assert request.proposals[0] == [3, 1]  # capped to the engine's limit
    # misses 1, 2, 3 skip 1, 2, 4 chances; the acceptance from step 8 on resets the back-off
    assert chances == [True, False, True, False, False, True, False, False, False, False, True, True]


def test_driver_leaves_pending_and_unready_requests_alone():
    driver = DraftDriver(FakeEngine(), NgramProposer(2, 2, 1))
    pending, unready = FakeRequest(1), FakeRequest(2)
    pending.draft_tokens = (5,)
    unready.ready_for_drafts = False
    driver.propose([pending, unready])
    assert pending.proposals == unready.proposals == []


def make_llm(**kwargs) -> pg.LLM:
    """A synthetic model with a small vocabulary, so its output repeats n-grams now and then."""
    config = pg.EngineConfig(max_batch_size=4, num_blocks=64, debug_invariants=True)
    return pg.LLM(SyntheticModel(vocab_size=13), config, **kwargs)


def test_llm_with_the_ngram_proposer_generates_exactly_the_same_output():
    prompts = [[1, 2, 3, 1, 2], [4, 2, 9, 11, 4, 2], [7, 7, 7, 7]]
    for temperature in (0.0, 0.8):
        params = pg.SamplingParams(max_tokens=40, temperature=temperature, seed=3)
        plain = make_llm().generate(prompts, params, use_tqdm=False)
        llm = make_llm(speculative="ngram", num_speculative_tokens=3)
        drafted = llm.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
        assert sum(o.drafts_proposed for o in drafted) == llm.engine.stats().drafts_proposed > 0
        assert sum(o.drafts_accepted for o in drafted) == llm.engine.stats().drafts_accepted


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"speculative": "eagle"}, "speculative"),
        ({"speculative": "ngram", "num_speculative_tokens": 9}, r"\[1, 8\]"),
        ({"speculative": "ngram", "num_speculative_tokens": 0}, r"\[1, 8\]"),
    ],
)
def test_llm_refuses_bad_speculative_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_llm(**kwargs)


class OracleProposer:
    """A replacement proposer: the synthetic model's true continuation, its third token corrupted."""

    def propose(self, tokens):
        truth = synthetic_greedy(list(tokens), 4, 13)
        return truth[:2] + [(truth[2] + 1) % 13, truth[3]]


def test_the_proposer_is_replaceable():
    llm = make_llm(speculative="ngram", num_speculative_tokens=4)
    llm.drafter = DraftDriver(llm.engine, OracleProposer())
    (out,) = llm.generate([[3, 4, 5]], pg.SamplingParams(max_tokens=30, temperature=0.0), use_tqdm=False)
    assert out.token_ids == synthetic_greedy([3, 4, 5], 30, 13)
    assert 0 < out.drafts_accepted <= out.drafts_proposed // 2 + 2  # two of four, less where limits cut


def test_driver_proposes_only_while_few_requests_decode():
    driver = DraftDriver(FakeEngine(), NgramProposer(2, 2, 1), max_batch=2)
    many = [FakeRequest(i) for i in range(3)]
    driver.propose(many)
    assert all(r.proposals == [] for r in many)  # a large batch: verification rows cost like decodes
    many[2].ready_for_drafts = False  # two decoding, one prefilling
    driver.propose(many)
    assert [len(r.proposals) for r in many] == [1, 1, 0]
