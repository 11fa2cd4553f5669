"""Per-request random streams: counter-based, so they are batch invariant and trivially checkpointed.

A request's random stream must survive changes of batch order and membership, and be checkpointed with the
step transaction (docs/engine.md). We get both for free from a
counter-based generator: the uniform of a request's n-th draw is a pure function of ``(seed, n)``
(splitmix64 finaliser, computed vectorised in numpy uint64), so a request's stream never depends on its
neighbours or its row, the whole state is one integer, and a checkpoint is a copy of that integer.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pagedgen.errors import SamplingError
from pagedgen.sampling.options import SamplingOptions

_GAMMA = np.uint64(0x9E3779B97F4A7C15)  # splitmix64 increment (golden ratio)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_MASK64 = (1 << 64) - 1


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijective avalanche of uint64 values (array arithmetic wraps mod 2**64)."""
    z = (z ^ (z >> np.uint64(30))) * _MUL1
    z = (z ^ (z >> np.uint64(27))) * _MUL2
    return z ^ (z >> np.uint64(31))


def stream_uniforms(seeds: Sequence[int], counters: Sequence[int]) -> np.ndarray:
    """The uniform in [0, 1) of draw ``counters[i]`` of stream ``seeds[i]``, for every i.  # [n] float64

    ``u = mix(mix(seed) + (counter + 1) * gamma)``: the seed is mixed first so that nearby seeds start far
    apart, then each draw is splitmix64's output for that counter. The top 53 bits make the float, so u < 1.
    """
    seed_arr = np.array([s & _MASK64 for s in seeds], dtype=np.uint64)  # [n]
    ctr_arr = np.array(counters, dtype=np.uint64)  # [n]
    bits = _mix64(_mix64(seed_arr) + (ctr_arr + np.uint64(1)) * _GAMMA)  # [n]
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def fresh_seed() -> int:
    """A new random seed for a request that gave none (63 bits, so it fits any signed int64 consumer)."""
    return secrets.randbits(63)


@dataclass(frozen=True, slots=True)
class SamplerCheckpoint:
    """An immutable snapshot of one :class:`RequestSampler`'s state (its draw counter)."""

    owner: object
    draws: int


class RequestSampler:
    """One request's persistent sampling state: its options, its seed and how many uniforms it has drawn.

    Created once per request and kept across turns. Only :meth:`advance` (called by the batched sampler for
    rows that drew a random number) and :meth:`restore` mutate it.
    """

    __slots__ = ("options", "seed", "_draws", "_identity")

    def __init__(self, options: SamplingOptions) -> None:
        if not isinstance(options, SamplingOptions):
            raise SamplingError(f"RequestSampler needs a SamplingOptions, got {type(options).__name__}")
        self.options = options
        self.seed: int = fresh_seed() if options.seed is None else options.seed
        self._draws = 0
        self._identity = object()

    @property
    def draws(self) -> int:
        """How many uniforms this request has consumed (the index of its next draw)."""
        return self._draws

    def advance(self) -> None:
        """Consume one draw; called once per sampled (non-greedy) token."""
        self._draws += 1

    def checkpoint(self) -> SamplerCheckpoint:
        return SamplerCheckpoint(self._identity, self._draws)

    def snapshot(self) -> tuple[int, int]:
        """``(seed, draws)``: everything a later draw depends on besides the options."""
        return self.seed, self._draws

    def restore(self, checkpoint: object) -> None:
        """Roll back to ``checkpoint``; raises :class:`SamplingError` (changing nothing) if it is not ours."""
        if not isinstance(checkpoint, SamplerCheckpoint) or checkpoint.owner is not self._identity:
            raise SamplingError("RequestSampler.restore was given a checkpoint taken from another sampler")
        self._draws = checkpoint.draws

    def __repr__(self) -> str:
        return f"RequestSampler(seed={self.seed}, draws={self._draws}, options={self.options})"
