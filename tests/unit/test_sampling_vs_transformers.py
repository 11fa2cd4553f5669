"""Each processor / warper equals transformers' on random logits and histories, bitwise.

Our functions process a whole step (one parameter per row); transformers' processors are applied to each
row alone with that row's parameter. Equality is exact (``torch.equal``), -inf included.
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from pagedgen.sampling import RequestSampler, SampleRow, SamplingOptions
from pagedgen.sampling.processors import apply_no_repeat_ngram_, apply_repetition_penalty_
from pagedgen.sampling.sampler import process_logits
from pagedgen.sampling.warpers import apply_min_p, apply_temperature, apply_top_k, apply_top_p, warp

pytestmark = pytest.mark.model  # imports transformers

VOCAB = 64
ROWS = 12


def _logits(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, VOCAB, generator=g) * 3  # [R, V]
    x[torch.rand(ROWS, VOCAB, generator=g) < 0.05] = -float("inf")  # some already-banned tokens
    x[:, 0] = torch.randn(ROWS, generator=g)  # keep a finite token in every row
    return x


def _histories(seed: int) -> list[list[int]]:
    """Rows of different lengths (0..40) over a small alphabet so n-grams repeat; a few ids >= VOCAB."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(ROWS):
        length = int(torch.randint(0, 41, (1,), generator=g))
        alphabet = 6 if r % 2 else VOCAB + 3
        out.append(torch.randint(0, alphabet, (length,), generator=g).tolist())
    return out


def _per_row(processors: list, histories: list[list[int]], logits: torch.Tensor) -> torch.Tensor:
    rows = []
    for r, proc in enumerate(processors):
        ids = torch.tensor([histories[r]], dtype=torch.long).reshape(1, -1)
        rows.append(proc(ids, logits[r : r + 1].clone()))
    return torch.cat(rows)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_repetition_penalty(seed: int) -> None:
    logits, hist = _logits(seed), _histories(seed)
    penalties = [0.5, 0.8, 1.0, 1.1, 1.3, 2.0] * 2
    ours = logits.clone()
    apply_repetition_penalty_(ours, range(ROWS), hist, penalties)
    theirs = _per_row([RepetitionPenaltyLogitsProcessor(p) for p in penalties], hist, logits)
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, logits)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_no_repeat_ngram(seed: int, n: int) -> None:
    logits, hist = _logits(seed), _histories(seed)
    ours = logits.clone()
    apply_no_repeat_ngram_(ours, range(ROWS), hist, n)
    theirs = _per_row([NoRepeatNGramLogitsProcessor(n)] * ROWS, hist, logits)
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, logits)


@pytest.mark.parametrize("seed", [0, 1])
def test_warpers_one_by_one(seed: int) -> None:
    logits = _logits(seed)
    temps = [0.3, 0.7, 1.0, 1.5] * 3
    ks = [1, 3, 10, 50, 64, 100] * 2
    ps = [0.05, 0.3, 0.5, 0.8, 0.95, 0.999] * 2
    mins = [0.001, 0.05, 0.1, 0.3, 0.9, 1.0] * 2
    cases = [
        (apply_temperature, temps, TemperatureLogitsWarper),
        (apply_top_k, ks, TopKLogitsWarper),
        (apply_top_p, ps, TopPLogitsWarper),
        (apply_min_p, mins, MinPLogitsWarper),
    ]
    hist = [[]] * ROWS
    for ours_fn, values, theirs_cls in cases:
        ours = ours_fn(logits, values)
        theirs = _per_row([theirs_cls(v) for v in values], hist, logits)
        assert torch.equal(ours, theirs), theirs_cls.__name__


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_warp_chain_with_mixed_and_disabled_rows(seed: int) -> None:
    """Mixed settings in one call; disabled warpers (k=0, p=1, min_p=0) are skipped as transformers does."""
    logits = _logits(seed)
    g = torch.Generator().manual_seed(100 + seed)
    temps = (torch.rand(ROWS, generator=g) * 1.5 + 0.2).tolist()
    ks = [0, 5, 20, 0, 2, 40] * 2
    ps = [1.0, 0.9, 0.6, 0.75, 1.0, 0.95] * 2
    mins = [0.0, 0.0, 0.05, 0.2, 0.1, 0.0] * 2
    ours = warp(logits, temps, ks, ps, mins)
    procs = []
    for t, k, p, m in zip(temps, ks, ps, mins, strict=True):
        chain = [TemperatureLogitsWarper(t)]
        chain += [TopKLogitsWarper(k)] if k > 0 else []
        chain += [TopPLogitsWarper(p)] if p < 1 else []
        chain += [MinPLogitsWarper(m)] if m > 0 else []
        procs.append(LogitsProcessorList(chain))
    assert torch.equal(ours, _per_row(procs, [[]] * ROWS, logits))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_process_logits_matches_transformers_processor_list(seed: int) -> None:
    """The Sampler's processor stage (min length, min new tokens, repetition, n-gram), mixed settings."""
    logits, hist = _logits(seed), _histories(seed)
    eos = (1, 2, 70)  # 70 is outside the vocab: ignored, like torch.isin over the vocab range
    rows, procs = [], []
    for r in range(ROWS):
        options = SamplingOptions(
            repetition_penalty=[1.0, 1.2, 0.9][r % 3],
            no_repeat_ngram_size=[0, 2, 3, 1][r % 4],
            min_length=[0, 20, 45][r % 3],
            min_new_tokens=[0, 3][r % 2],
        )
        prompt = len(hist[r]) // 2
        rows.append(
            SampleRow(RequestSampler(options), hist[r], prompt, hist[r][prompt:], len(hist[r]) - prompt, eos)
        )
        chain = []
        if options.repetition_penalty != 1.0:
            chain.append(RepetitionPenaltyLogitsProcessor(options.repetition_penalty))
        if options.no_repeat_ngram_size:
            chain.append(NoRepeatNGramLogitsProcessor(options.no_repeat_ngram_size))
        # The logits are CPU tensors: these processors keep their EOS ids on the device they are given.
        chain.append(MinLengthLogitsProcessor(options.min_length, list(eos), device="cpu"))
        chain.append(
            MinNewTokensLengthLogitsProcessor(prompt, options.min_new_tokens, list(eos), device="cpu")
        )
        procs.append(LogitsProcessorList(chain))
    before = logits.clone()
    ours = process_logits(logits, rows)
    assert torch.equal(logits, before)  # the caller's logits are untouched
    assert torch.equal(ours, _per_row(procs, hist, logits))
    assert not torch.equal(ours, logits)


def test_warpers_at_their_boundaries() -> None:
    """Exact ties and thresholds: top-p where a cumulative probability equals 1 - p, min-p = 1 with a tied top
    token, top-k with ties at the k-th value. These pin ``<=`` vs ``<`` to transformers' choice."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(ROWS, VOCAB, generator=g)  # distinct values: sort orders agree
    cumulative = torch.sort(logits, descending=False).values.softmax(-1).cumsum(-1)  # [R, V]
    ps = [1.0 - float(cumulative[r, 10 + 3 * r]) for r in range(ROWS)]  # float32(1 - p) == that cumulative
    assert torch.equal(
        apply_top_p(logits, ps), _per_row([TopPLogitsWarper(p) for p in ps], [[]] * ROWS, logits)
    )

    tied = torch.randint(-3, 3, (ROWS, VOCAB), generator=g).float()  # many exact ties
    ks = list(range(1, ROWS + 1))
    assert torch.equal(apply_top_k(tied, ks), _per_row([TopKLogitsWarper(k) for k in ks], [[]] * ROWS, tied))
    mins = [1.0] * ROWS
    ours = apply_min_p(tied, mins)
    assert torch.equal(ours, _per_row([MinPLogitsWarper(1.0)] * ROWS, [[]] * ROWS, tied))
    assert torch.equal(torch.isfinite(ours), tied == tied.amax(-1, keepdim=True))  # all tied maxima kept
