"""Verifying speculative drafts: from a request's K+1 logits rows to the tokens it emits this step.

A request that sends its one unprocessed token followed by drafts ``d_1..d_K`` gets K+1 logits rows: row
``i`` predicts the token after ``d_i`` (row 0: after the unprocessed token). Row ``i`` is processed as if
``d_1..d_i`` had already been accepted: its :class:`SampleRow` carries that extended context, so a processor
that reads the sequence (repetition penalty, no-repeat n-gram, ``min_length``, presence / frequency
penalties) sees exactly what it would have seen without speculation. That is why drafts need no restriction
on the logits processors.

- **Greedy rows** accept the longest prefix of drafts equal to the rows' argmax; the first mismatching row's
  argmax replaces its draft, or row K supplies a bonus token when every draft matched. The output is token
  for token the non-speculative greedy output.
- **Sampled rows** use speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023; vLLM's
  ``RejectionSampler``) with the caller's draft as a point-mass proposal ``q = delta(d_i)``: ``d_i`` is
  accepted with probability ``min(1, p_i(d_i) / q(d_i)) = p_i(d_i)``; at the first rejection the token is
  drawn from the residual ``max(0, p_i - q)`` renormalised, i.e. ``p_i`` without ``d_i``; after K acceptances
  a bonus token is drawn from ``p_K``. Every emitted token is therefore distributed exactly as ``p`` given
  its prefix (``P(d) = p(d)``; ``P(x != d) = (1 - p(d)) p(x) / (1 - p(d))``). ``p_i`` is the processed and
  warped distribution the non-speculative sampler draws from. The request's stream always advances by K+1
  draws (K acceptance tests, one final draw), so a replayed step draws the same numbers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedgen.sampling.errors import RowSamplingError
from pagedgen.sampling.logprobs import compute_logprobs
from pagedgen.sampling.sampler import SampledToken, Sampler, SampleRow, inverse_cdf_sample, process_logits
from pagedgen.sampling.streams import stream_uniforms
from pagedgen.sampling.warpers import warp


@dataclass(slots=True)
class VerifiedRow:
    """What one sampling row produced: the accepted drafts, then the replacement or bonus token."""

    outputs: list[SampledToken]
    num_drafts: int = 0  # drafts verified for this row
    num_accepted: int = 0  # of those, accepted (the matching prefix)


def sample_with_drafts(
    sampler: Sampler, logits: torch.Tensor, rows: Sequence[SampleRow], drafts: Sequence[Sequence[int]]
) -> list[VerifiedRow]:
    """Sample every row of a step, verifying each row's drafts (``drafts[r]``, maybe empty).

    ``logits`` holds ``len(drafts[r]) + 1`` consecutive rows per sampling row ``r`` (``[sum, vocab]``).
    Raises :class:`RowSamplingError` naming the sampling row ``r`` that cannot be sampled, changing no
    sampler state (every draw is committed only after every row succeeded).
    """
    if not any(drafts):
        return [VerifiedRow([token]) for token in sampler.sample(logits, rows)]
    starts = _row_starts(drafts)
    batched = [r for r, row in enumerate(rows) if not drafts[r] or row.sampler.options.is_greedy]
    rejection = [r for r in range(len(rows)) if drafts[r] and not rows[r].sampler.options.is_greedy]
    result: list[VerifiedRow | None] = [None] * len(rows)
    for r in rejection:  # reads the streams without advancing them
        result[r] = _plan_rejection(logits[starts[r] : starts[r + 1]], rows[r], drafts[r], r)
    if batched:
        index = torch.tensor([i for r in batched for i in range(starts[r], starts[r + 1])])
        owner = [r for r in batched for _ in range(len(drafts[r]) + 1)]
        expanded = [ext for r in batched for ext in _extend(rows[r], drafts[r])]
        try:
            tokens = sampler.sample(logits.index_select(0, index.to(logits.device)), expanded)
        except RowSamplingError as error:
            raise RowSamplingError(str(error), owner[error.row]) from error
        at = 0
        for r in batched:
            width = len(drafts[r]) + 1
            result[r] = _accept_greedy(tokens[at : at + width], drafts[r])
            at += width
    for r in rejection:  # nothing can fail any more: advance the streams
        for _ in range(len(drafts[r]) + 1):
            rows[r].sampler.advance()
    return [row for row in result if row is not None]


def _row_starts(drafts: Sequence[Sequence[int]]) -> list[int]:
    starts = [0]
    for d in drafts:
        starts.append(starts[-1] + len(d) + 1)
    return starts


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


def _accept_greedy(tokens: list[SampledToken], drafts: Sequence[int]) -> VerifiedRow:
    """Longest prefix of ``drafts`` equal to the rows' argmax, then the first row that disagrees (or K)."""
    accepted = 0
    while accepted < len(drafts) and tokens[accepted].token == drafts[accepted]:
        accepted += 1
    return VerifiedRow(tokens[: accepted + 1], len(drafts), accepted)


def _plan_rejection(logits: torch.Tensor, row: SampleRow, drafts: Sequence[int], r: int) -> VerifiedRow:
    """Rejection-sample one sampled request's K+1 rows; reads its stream but does not advance it."""
    k = len(drafts)
    rows = _extend(row, drafts)
    x = process_logits(logits, rows)  # [K+1, V]
    o = row.sampler.options
    y = warp(x, [o.temperature] * (k + 1), [o.top_k] * (k + 1), [o.top_p] * (k + 1), [o.min_p] * (k + 1))
    if not bool(torch.isfinite(y.amax(dim=-1)).all()):
        raise RowSamplingError(f"row {r}: a draft row has no sampleable token", r)
    probs = torch.softmax(y.float(), dim=-1)  # [K+1, V]
    u = stream_uniforms([row.sampler.seed] * (k + 1), [row.sampler.draws + i for i in range(k + 1)])
    draft_ids = torch.tensor(list(drafts), dtype=torch.long, device=probs.device)  # [K]
    p_draft = probs[:k].gather(1, draft_ids[:, None]).squeeze(1).tolist()  # [K]
    sole = ((probs[:k] > 0).sum(dim=-1) == 1).tolist()  # only the draft has mass: always accepted
    accepted = 0
    while accepted < k and (u[accepted] < p_draft[accepted] or (sole[accepted] and p_draft[accepted] > 0)):
        accepted += 1
    final = y[accepted : accepted + 1]
    if accepted < k:  # the residual: p without the rejected draft
        final = final.clone()
        final[0, drafts[accepted]] = -float("inf")
    last = inverse_cdf_sample(final, torch.tensor(u[k : k + 1], device=y.device))  # [1]
    tokens = [*drafts[:accepted], int(last[0])]
    chosen = torch.tensor(tokens, dtype=torch.long, device=y.device)
    logprobs = compute_logprobs(y[: accepted + 1], chosen, [row.num_logprobs] * (accepted + 1))
    outputs = [
        SampledToken(t) if lp is None else SampledToken(t, lp.logprob, lp.top)
        for t, lp in zip(tokens, logprobs, strict=True)
    ]
    return VerifiedRow(outputs, k, accepted)
