"""Counter-based per-request streams: a pure function of (seed, draw index); checkpoint = the counter."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagedgen.errors import SamplingError
from pagedgen.sampling import RequestSampler, SamplingOptions, stream_uniforms

M64 = (1 << 64) - 1


def _mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _oracle(seed: int, n: int) -> float:
    """splitmix64 in plain Python integers: the documented formula, independent of numpy's wrapping."""
    bits = _mix((_mix(seed & M64) + (n + 1) * 0x9E3779B97F4A7C15) & M64)
    return (bits >> 11) / float(1 << 53)


def test_uniforms_match_the_integer_formula() -> None:
    seeds = [0, 1, 12345, M64, -1, 2**63 + 5]
    counters = [0, 0, 7, 3, 3, 1000]
    got = stream_uniforms(seeds, counters)
    assert got.tolist() == [_oracle(s, n) for s, n in zip(seeds, counters, strict=True)]
    assert got[4] == got[3]  # a negative seed is taken mod 2**64, like torch.manual_seed
    assert got.tolist()[:2] == [0.8833108082136426, 0.7497482413580301]  # pinned: streams are reproducible


def test_each_draw_depends_only_on_its_own_seed_and_counter() -> None:
    seeds = list(range(50))
    counters = [s % 7 for s in seeds]
    batch = stream_uniforms(seeds, counters)
    perm = np.random.default_rng(0).permutation(50)
    shuffled = stream_uniforms([seeds[i] for i in perm], [counters[i] for i in perm])
    assert shuffled.tolist() == batch[perm].tolist()
    alone = [stream_uniforms([s], [c])[0] for s, c in zip(seeds, counters, strict=True)]
    assert alone == batch.tolist()


def test_uniforms_are_uniform() -> None:
    """20k draws (200 seeds x 100 counters) in 20 bins: chi-square p-value above 1e-3; all in [0, 1)."""
    seeds = np.repeat(np.arange(200), 100).tolist()
    counters = np.tile(np.arange(100), 200).tolist()
    u = stream_uniforms(seeds, counters)
    assert u.min() >= 0.0 and u.max() < 1.0
    observed = np.bincount((u * 20).astype(np.int64), minlength=20)
    expected = len(u) / 20
    stat = float(((observed - expected) ** 2 / expected).sum())
    p_value = float(
        torch.special.gammaincc(torch.tensor(19 / 2, dtype=torch.float64), torch.tensor(stat / 2))
    )
    assert p_value > 1e-3, (stat, observed)
    assert len(set(u.tolist())) == len(u)  # no repeats across streams and counters


def test_request_sampler_seed_and_checkpoint() -> None:
    fixed = RequestSampler(SamplingOptions(seed=42))
    assert fixed.seed == 42 and fixed.draws == 0
    a, b = RequestSampler(SamplingOptions()), RequestSampler(SamplingOptions())
    assert a.seed != b.seed and 0 <= a.seed < 2**63  # fresh random seeds, recorded
    cp = fixed.checkpoint()
    fixed.advance()
    fixed.advance()
    assert fixed.draws == 2
    fixed.restore(cp)
    assert fixed.draws == 0
    fixed.advance()
    with pytest.raises(SamplingError, match="another sampler"):
        fixed.restore(a.checkpoint())
    assert fixed.draws == 1  # a refused restore changes nothing
    with pytest.raises(SamplingError):
        RequestSampler({"seed": 1})  # type: ignore[arg-type]


def test_chi_square_helper_rejects_a_wrong_distribution() -> None:
    """The gammaincc p-value used by the statistical tests has power: a skewed sample is rejected."""
    observed = np.array([1200, 800] + [1000] * 18)
    stat = float(((observed - 1000) ** 2 / 1000).sum())
    p_value = float(
        torch.special.gammaincc(torch.tensor(19 / 2, dtype=torch.float64), torch.tensor(stat / 2))
    )
    assert math.isclose(stat, 80.0) and p_value < 1e-8
