"""Verifying speculative drafts: from a request's K+1 logits rows to the tokens it emits this step.

Row ``i`` is processed as if drafts ``1..i`` had been accepted and sampled with the request's stream at the
draw index its token has without drafts; the longest prefix of drafts equal to the rows' tokens is accepted,
then the first disagreeing row supplies the replacement (or row K a bonus token). For sampled rows this is
rejection sampling with the draft as a point-mass proposal, coupled to the target draw, so the output
distribution is exact and the emitted tokens are those of the same request without drafts. The argument
in full: docs/engine.md, "Speculative drafts".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from pagedgen.errors import RowSamplingError
from pagedgen.guidance.bitmask import TokenMasks
from pagedgen.sampling.sampler import SampledToken, Sampler, SampleRow


@dataclass(slots=True)
class VerifiedRow:
    """What one sampling row produced: the accepted drafts, then the replacement or bonus token."""

    outputs: list[SampledToken]
    num_drafts: int = 0  # drafts verified for this row
    num_accepted: int = 0  # of those, accepted (the matching prefix)


def sample_with_drafts(
    sampler: Sampler,
    logits,
    rows: Sequence[SampleRow],
    drafts: Sequence[Sequence[int]],
    masks: TokenMasks | None = None,
) -> list[VerifiedRow]:
    """Sample every row of a step, verifying each row's drafts (``drafts[r]``, maybe empty).

    ``masks`` (guidance) index the logits rows, draft rows included: row ``i`` of a request is masked by
    its grammar after ``d_1..d_i``, so a draft the grammar rejects is never accepted.

    ``logits`` (a ``[sum_r (len(drafts[r]) + 1), vocab]`` tensor) holds ``len(drafts[r]) + 1`` consecutive
    rows per sampling row ``r``. Raises :class:`RowSamplingError` naming the sampling row ``r`` that cannot be
    sampled, changing no sampler state.
    """
    if not any(drafts):
        return [VerifiedRow([token]) for token in sampler.sample(logits, rows, masks)]
    expanded = [ext for row, d in zip(rows, drafts, strict=True) for ext in _extend(row, d)]
    owner = [r for r, d in enumerate(drafts) for _ in range(len(d) + 1)]
    before = [row.sampler.checkpoint() for row in rows]
    try:
        tokens = sampler.sample(logits, expanded, masks)
    except RowSamplingError as error:
        raise RowSamplingError(str(error), owner[error.row]) from error
    result = []
    at = 0
    for row, d, checkpoint in zip(rows, drafts, before, strict=True):
        verified = _accept(tokens[at : at + len(d) + 1], d)
        at += len(d) + 1
        if not row.sampler.options.is_greedy:  # one draw per emitted token, as without drafts
            row.sampler.restore(checkpoint)
            for _ in verified.outputs:
                row.sampler.advance()
        result.append(verified)
    return result


def _extend(row: SampleRow, drafts: Sequence[int]) -> list[SampleRow]:
    """The K+1 sample rows of one request: row i's context ends with ``drafts[:i]``."""
    out = [row]
    for i in range(1, len(drafts) + 1):
        head = list(drafts[:i])
        out.append(
            dataclasses.replace(
                row,
                tokens=[*row.tokens, *head],
                generated=[*row.generated, *head],
                turn_generated=row.turn_generated + i,
            )
        )
    return out


def _accept(tokens: list[SampledToken], drafts: Sequence[int]) -> VerifiedRow:
    """Longest prefix of ``drafts`` equal to the rows' tokens, then the first row that disagrees (or K)."""
    accepted = 0
    while accepted < len(drafts) and tokens[accepted].token == drafts[accepted]:
        accepted += 1
    return VerifiedRow(tokens[: accepted + 1], len(drafts), accepted)
