"""The batched sampler: batch invariance of seeded streams, rollback, statistics, penalties, refusals."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from pagedgen.errors import SamplingError
from pagedgen.sampling import RequestSampler, SampledToken, Sampler, SampleRow, SamplingOptions
from pagedgen.sampling.sampler import inverse_cdf_sample, process_logits

VOCAB = 97
EOS = 3


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny tensors: intra-op threads only add contention on shared CI cores (runtime, not results)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _mixed_options(i: int, seed_offset: int = 0) -> SamplingOptions:
    """16 different settings: greedy, plain sampling, every warper and processor, alone and combined."""
    table = [
        {},
        {"do_sample": True},
        {"do_sample": True, "temperature": 0.6},
        {"do_sample": True, "top_k": 5},
        {"do_sample": True, "top_p": 0.7},
        {"do_sample": True, "min_p": 0.1},
        {"do_sample": True, "temperature": 1.4, "top_k": 20, "top_p": 0.9, "min_p": 0.02},
        {"repetition_penalty": 1.3},
        {"do_sample": True, "repetition_penalty": 1.2, "no_repeat_ngram_size": 2},
        {"do_sample": True, "presence_penalty": 1.0, "frequency_penalty": 0.5},
        {"do_sample": True, "logit_bias": ((5, 3.0), (6, -100.0))},
        {"do_sample": True, "temperature": 0.0},
        {"do_sample": True, "min_new_tokens": 4, "min_length": 12},
        {"no_repeat_ngram_size": 1},
        {"do_sample": True, "top_k": 1, "temperature": 0.9},
        {"do_sample": True, "temperature": 0.8, "top_p": 0.95, "no_repeat_ngram_size": 3},
    ]
    return SamplingOptions(seed=1000 + i + seed_offset, **table[i % len(table)])


def _step_logits(request: int, step: int) -> torch.Tensor:
    """A request's logits at a step: a function of (request, step) only, like a batch-invariant model."""
    g = torch.Generator().manual_seed(request * 10_000 + step)
    x = torch.randn(VOCAB, generator=g) * 2.5  # [V]
    x[EOS] = x.max() + 1.0  # EOS is the favourite: min-length handling must hold it back
    return x


@dataclass
class _Request:
    rid: int
    sampler: RequestSampler
    prompt: list[int]
    generated: list[int] = field(default_factory=list)

    def row(self, num_logprobs: int = 0) -> SampleRow:
        tokens = self.prompt + self.generated
        return SampleRow(
            self.sampler, tokens, len(self.prompt), self.generated, len(self.generated), (EOS,), num_logprobs
        )


def _requests(ids: list[int], seed_offset: int = 0) -> list[_Request]:
    return [
        _Request(i, RequestSampler(_mixed_options(i, seed_offset)), [7 + i, 11, 7 + i, 11, 13]) for i in ids
    ]


def _step(sampler: Sampler, reqs: list[_Request], step: int, order: list[int]) -> dict[int, int]:
    batch = [reqs[j] for j in order]
    logits = torch.stack([_step_logits(r.rid, step) for r in batch])  # [R, V]
    out = sampler.sample(logits, [r.row() for r in batch])
    return {r.rid: s.token for r, s in zip(batch, out, strict=True)}


def _run(ids: list[int], batch_size: int, steps: int, shuffle_seed: int, rollback_every: int = 0) -> dict:
    """Generate ``steps`` tokens for every request in batches of ``batch_size`` rows, shuffled each step.

    With ``rollback_every``, those steps sample, roll every sampler back, then sample again in another
    order (an injected retryable failure); the second result must equal the first.
    """
    reqs = _requests(ids)
    rng = random.Random(shuffle_seed)
    sampler = Sampler()
    for step in range(steps):
        rng.shuffle(reqs)
        for start in range(0, len(reqs), batch_size):
            group = reqs[start : start + batch_size]
            order = list(range(len(group)))
            rng.shuffle(order)
            if rollback_every and step % rollback_every == 0:
                checkpoints = [r.sampler.checkpoint() for r in group]
                first = _step(sampler, group, step, order)
                for r, cp in zip(group, checkpoints, strict=True):
                    r.sampler.restore(cp)
                assert _step(sampler, group, step, order[::-1]) == first
            else:
                first = _step(sampler, group, step, order)
            for r in group:
                r.generated.append(first[r.rid])
    return {r.rid: (r.generated, r.sampler.draws) for r in reqs}


STEPS = 10


def test_seeded_streams_are_batch_invariant_and_survive_rollback() -> None:
    ids = list(range(16))
    alone = {}
    for i in ids:
        alone |= _run([i], 1, STEPS, shuffle_seed=0)
    assert _run([5], 1, STEPS, shuffle_seed=1) == {5: alone[5]}  # same seed alone: same tokens
    for batch_size, shuffle_seed in [(1, 2), (4, 3), (16, 4), (16, 5)]:
        assert _run(ids, batch_size, STEPS, shuffle_seed) == alone, (batch_size, shuffle_seed)
    assert _run(ids, 16, STEPS, shuffle_seed=6, rollback_every=2) == alone
    assert _run(ids, 4, STEPS, shuffle_seed=7, rollback_every=3) == alone
    # the test has power: sampled requests vary, greedy ones never draw, and another seed changes a stream
    sampled = [i for i in ids if not _mixed_options(i).is_greedy]
    assert all(alone[i][1] == STEPS for i in sampled)
    assert all(alone[i][1] == 0 for i in ids if i not in sampled)
    assert any(len(set(alone[i][0])) > 3 for i in sampled)
    other = _requests(sampled, seed_offset=500)
    sampler = Sampler()
    for step in range(STEPS):
        for r, tok in zip(other, _step(sampler, other, step, list(range(len(other)))).values(), strict=True):
            r.generated.append(tok)
    assert any(r.generated != alone[r.rid][0] for r in other)


def test_min_length_holds_eos_back_then_releases_it() -> None:
    """EOS is every row's argmax; min_new_tokens / min_length suppress it exactly while below the minimum."""
    logits = torch.zeros(4, 8)
    logits[:, EOS] = 5.0
    logits[:, 6] = 4.0
    sampler = Sampler()
    rows = [
        SampleRow(RequestSampler(SamplingOptions(min_new_tokens=2)), [1, 2, 9], 2, [9], 1, (EOS,)),
        SampleRow(RequestSampler(SamplingOptions(min_new_tokens=2)), [1, 2, 9, 9], 2, [9, 9], 2, (EOS,)),
        SampleRow(RequestSampler(SamplingOptions(min_length=5)), [1, 2, 9, 9], 2, [9, 9], 2, (EOS, 7)),
        SampleRow(
            RequestSampler(SamplingOptions(min_length=4, ignore_eos=True)), [1, 2, 9, 9], 2, [9], 1, (EOS,)
        ),
    ]
    assert [s.token for s in sampler.sample(logits, rows)] == [6, EOS, 6, EOS]


def test_rows_of_one_request_draw_consecutive_numbers() -> None:
    """Two rows of the same request in one call equal two successive single-row calls."""
    options = SamplingOptions(do_sample=True, seed=9)
    logits = _step_logits(1, 0).repeat(2, 1)  # [2, V]
    together = RequestSampler(options)
    row = SampleRow(together, [1, 2], 2, [], 0, (EOS,))
    both = [s.token for s in Sampler().sample(logits, [row, row])]
    apart = RequestSampler(options)
    row_apart = SampleRow(apart, [1, 2], 2, [], 0, (EOS,))
    one_by_one = [Sampler().sample(logits[:1], [row_apart])[0].token for _ in range(2)]
    assert both == one_by_one and together.draws == apart.draws == 2


def test_penalties_and_bias_follow_openai_formula_and_logits_are_untouched() -> None:
    options = SamplingOptions(
        presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((4, 2.0), (9, -100.0))
    )
    logits = torch.randn(2, 12, generator=torch.Generator().manual_seed(3))
    before = logits.clone()
    generated = [1, 1, 1, 5, 11, 11]
    rows = [
        SampleRow(RequestSampler(options), [1, 2, 3] + generated, 3, generated, 6, (EOS,)),
        SampleRow(RequestSampler(SamplingOptions(ignore_eos=True)), [1, 2, 3], 3, [], 0, (EOS,)),
    ]
    out = process_logits(logits, rows)
    counts = torch.bincount(torch.tensor(generated), minlength=12).float()
    expected = logits[0] - 0.25 * counts - 0.5 * (counts > 0).float()  # prompt tokens 2, 3 are not penalised
    expected[4] += 2.0
    expected[9] -= 100.0
    assert torch.equal(out[0], expected)
    assert torch.equal(out[1], logits[1])  # ignore_eos does not touch the logits
    assert torch.equal(logits, before)
    plain = logits[1:]
    assert process_logits(plain, rows[1:]) is plain  # no processor: no copy at all


def test_all_greedy_is_argmax_with_first_index_on_ties() -> None:
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, 1.0, 5.0, 0.0], [-1.0, -2.0, -3.0, -0.5]])
    rows = [SampleRow(RequestSampler(SamplingOptions()), [0], 1, [], 0, ()) for _ in range(3)]
    assert Sampler().sample(logits, rows) == [SampledToken(1), SampledToken(0), SampledToken(3)]


def test_a_tiny_temperature_samples_the_argmax_without_a_draw() -> None:
    """1e-300 in float32 is 0: dividing by it made NaN logits; below SAMPLING_EPS the row is greedy."""
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 1.0, 5.0, 0.0]])
    rows = [_row(SamplingOptions(do_sample=True, temperature=t, seed=4)) for t in (1e-300, 5e-324)]
    assert Sampler().sample(logits, rows) == [SampledToken(1), SampledToken(2)]
    assert [row.sampler.draws for row in rows] == [0, 0]


def _row(options: SamplingOptions, **kw) -> SampleRow:
    return SampleRow(RequestSampler(options), kw.get("tokens", [1, 2]), 2, [], 0, (EOS,), kw.get("n", 0))


def test_refused_calls_change_nothing() -> None:
    sampler = Sampler()
    good = _row(SamplingOptions(do_sample=True, seed=1))
    logits = torch.randn(2, 8)
    nan = logits.clone()
    nan[1, 2] = float("nan")
    all_banned = logits.clone()
    all_banned[1] = -float("inf")
    bad_calls = [
        (logits, [good]),  # row count mismatch
        (logits[0], [good]),  # not 2-D
        (logits, [good, _row(SamplingOptions(logit_bias=((8, 1.0),)))]),  # bias token outside the vocab
        (logits, [good, _row(SamplingOptions(repetition_penalty=1.2), tokens=[1, -4])]),  # negative token id
        (logits, [good, _row(SamplingOptions(), n=-1)]),
        (nan, [good, _row(SamplingOptions())]),
        (all_banned, [good, _row(SamplingOptions(do_sample=True))]),
    ]
    for bad_logits, rows in bad_calls:
        with pytest.raises(SamplingError):
            sampler.sample(bad_logits, rows)
        assert good.sampler.draws == 0
    assert sampler.sample(logits[:1], [good])[0].token in range(8)
    assert good.sampler.draws == 1


# ----------------------------------------------------------------------------------------------- statistics

FIXED = np.array([2.0, 1.5, 1.2, 1.0, 0.5, 0.3, 0.0, -0.5, -1.0, -2.0])
CONFIGS = [
    {"temperature": 0.7},
    {"top_k": 4},
    {"top_p": 0.8},
    {"min_p": 0.2},
    {"temperature": 1.3, "top_k": 7, "top_p": 0.9, "min_p": 0.05},
]
SAMPLES = 20_000


def _target(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """The warped distribution in float64, written from the definitions (transformers' rules)."""
    x = FIXED / temperature
    if top_k:
        x = np.where(x >= np.sort(x)[::-1][top_k - 1], x, -np.inf)
    p = np.exp(x - x.max())
    p /= p.sum()
    if top_p < 1:
        order = np.argsort(p)  # ascending
        tail = np.cumsum(p[order]) <= 1 - top_p  # the low tail transformers removes
        tail[-1] = False
        p[order[tail]] = 0
        p /= p.sum()
    if min_p > 0:
        p = np.where(p >= min_p * p.max(), p, 0)
        p /= p.sum()
    return p


def _p_value(counts: np.ndarray, target: np.ndarray) -> float:
    support = target > 0
    expected = target[support] * counts.sum()
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def test_sampled_frequencies_match_the_warped_distribution() -> None:
    """20k draws per setting (200 seeded requests x 100 steps), all five settings interleaved in each call."""
    rows = [_row(SamplingOptions(do_sample=True, seed=i, **CONFIGS[i % len(CONFIGS)])) for i in range(1000)]
    labels = np.arange(len(rows)) % len(CONFIGS)
    logits = torch.tensor(FIXED, dtype=torch.float32).repeat(len(rows), 1)  # [1000, 10]
    sampler = Sampler()
    tokens = np.array([[s.token for s in sampler.sample(logits, rows)] for _ in range(SAMPLES // 200)])
    assert all(row.sampler.draws == SAMPLES // 200 for row in rows)
    plain = _target()
    for c, config in enumerate(CONFIGS):
        counts = np.bincount(tokens[:, labels == c].reshape(-1), minlength=len(FIXED))
        assert counts.sum() == SAMPLES
        target = _target(**config)
        assert (counts[target == 0] == 0).all(), (config, counts)  # filtered tokens never appear
        assert _p_value(counts, target) > 1e-3, (config, counts, target * SAMPLES)
        assert _p_value(counts, plain) < 1e-6, config  # power: the unwarped distribution is rejected


def test_inverse_cdf_matches_a_flat_float64_reference() -> None:
    """The two-level (block) inverse CDF equals a plain cumulative-sum search over the whole vocabulary."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(6, 1000, generator=g) * 3  # [6, 1000]: four blocks, the last one partial
    logits[1, :600] = -float("inf")  # whole zero-probability blocks before the mass
    logits[2, 300:] = -float("inf")  # and after it
    logits[3, ::2] = -float("inf")
    u = torch.rand(6, 400, generator=g, dtype=torch.float64)
    u[:, 0], u[:, 1] = 0.0, 1.0 - 2.0**-53  # the extreme uniforms
    probs = torch.softmax(logits, dim=-1).double()
    cdf = probs.cumsum(dim=-1)
    for j in range(u.shape[1]):
        got = inverse_cdf_sample(logits, u[:, j])
        want = torch.searchsorted(cdf, (u[:, j] * cdf[:, -1])[:, None], right=True).squeeze(1)
        last_positive = torch.tensor([int((p > 0).nonzero().max()) for p in probs])
        assert torch.equal(got, torch.minimum(want, last_positive)), j
        assert bool((probs.gather(1, got[:, None]) > 0).all())
    assert inverse_cdf_sample(logits[1:3], u[1:3, 1]).tolist() == [999, 299]


def _greedy_row(num_logprobs: int = 0) -> SampleRow:
    return SampleRow(RequestSampler(SamplingOptions()), [5, 6], 1, [6], 1, (EOS,), num_logprobs)


def _torch_greedy(x: torch.Tensor) -> tuple[list[int], list[bool]]:
    """The general path's greedy tokens and bad-row flags (``torch.argmax``, the row max test)."""
    return x.argmax(dim=-1).tolist(), (~torch.isfinite(x.amax(dim=-1))).tolist()


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_the_host_argmax_of_all_greedy_rows_equals_torch_argmax_ties_included(rows):
    """All-greedy CPU rows without logprobs take numpy's argmax: the same first index of the maximum as
    ``torch.argmax``, on ties (small integer logits tie a lot), ``-inf`` entries and mixed signs."""
    gen = torch.Generator().manual_seed(rows)
    for trial in range(40):
        x = torch.randint(-3, 4, (rows, VOCAB), generator=gen).float()
        if trial % 3 == 0:
            x[torch.rand(rows, VOCAB, generator=gen) < 0.5] = float("-inf")
            x[:, VOCAB - 1] = -1.0  # every row keeps a finite logit
        if trial % 3 == 1:
            x = torch.randn(rows, VOCAB, generator=gen) * 1e-3
        tokens, bad = _torch_greedy(x)
        assert not any(bad)
        out = Sampler().sample(x, [_greedy_row() for _ in range(rows)])
        assert [t.token for t in out] == tokens
        assert all(t.logprob is None and t.top_logprobs == () for t in out)
        general = Sampler().sample(x, [_greedy_row(num_logprobs=1) for _ in range(rows)])  # the torch path
        assert [t.token for t in general] == tokens


@pytest.mark.parametrize("poison", ["nan", "+inf", "all -inf", "nan after +inf"])
def test_the_host_argmax_refuses_exactly_the_rows_the_general_path_refuses(poison):
    x = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(7))
    if poison == "nan":
        x[2, 10] = float("nan")
    elif poison == "+inf":
        x[2, 50] = float("inf")
    elif poison == "all -inf":
        x[2] = float("-inf")
    else:
        x[2, 5], x[2, 60] = float("inf"), float("nan")
    x[3, 0] = float("nan")  # a later bad row: the error names the first
    assert _torch_greedy(x)[1] == [False, False, True, True]
    for num_logprobs in (0, 1):  # the host path, then the general (torch) one
        with pytest.raises(SamplingError) as refused:
            Sampler().sample(x, [_greedy_row(num_logprobs) for _ in range(4)])
        assert refused.value.row == 2


def test_the_host_argmax_leaves_the_logits_and_the_streams_alone():
    x = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    before = x.clone()
    rows = [_greedy_row(), _greedy_row()]
    Sampler().sample(x, rows)
    assert torch.equal(x, before) and [row.sampler.draws for row in rows] == [0, 0]


@pytest.mark.parametrize(
    "settings", [{}, {"do_sample": True}, {"do_sample": True, "top_p": 0.8, "top_k": 50, "min_p": 0.01}]
)
def test_one_rows_tokens_and_logprobs_do_not_depend_on_torchs_thread_count(settings):
    """A one-row step samples with torch's pool parked at one thread (``ModelRunner.execute``): over a
    vocabulary above torch's parallel grain, the tokens and logprobs must be those of two threads."""
    vocab = 50257
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(11)) * 3
    results = []
    for threads in (2, 1):
        torch.set_num_threads(threads)
        options = SamplingOptions(seed=5, **settings)
        sampler = RequestSampler(options)
        row = SampleRow(sampler, [5, 6, 7], 1, [6, 7], 2, (EOS,), num_logprobs=3)
        plain = SampleRow(RequestSampler(options), [5, 6, 7], 1, [6, 7], 2, (EOS,))
        results.append([Sampler().sample(logits, [r])[0] for r in (row, row, plain, plain)])
    torch.set_num_threads(1)
    assert results[0] == results[1]
