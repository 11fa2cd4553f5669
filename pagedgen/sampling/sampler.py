"""The batched sampler: one call turns a step's logits rows into tokens, each row with its own settings.

Pipeline for a step (every stage vectorised over the rows that need it; rows that do not are untouched):

1. processors (all rows): EOS suppression under min_length / min_new_tokens, repetition penalty, no-repeat
   n-gram, presence / frequency penalties, logit bias (:mod:`pagedgen.sampling.processors`);
2. greedy rows: argmax of the processed logits (first index on ties, as ``torch.argmax`` / transformers);
3. sampled rows: temperature, top-k, top-p, min-p (:mod:`pagedgen.sampling.warpers`), then one uniform from
   the request's counter-based stream (:mod:`pagedgen.sampling.streams`) is mapped through the inverse CDF of
   the processed distribution, sorted by descending probability;
4. logprobs for rows that asked (:mod:`pagedgen.sampling.logprobs`);
5. only then, each sampled row's :class:`RequestSampler` advances by one draw.

Every row's float math is row-wise (softmax, sort, cumsum along the vocab), so a request's token depends only
on its own logits, settings, seed and draw count: never on its neighbours, its row or the batch size. Anything
that would make the call fail is detected before step 5, so a refused call changes no sampler state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedgen.sampling.errors import SamplingError
from pagedgen.sampling.logprobs import compute_logprobs
from pagedgen.sampling.processors import (
    apply_logit_bias,
    apply_no_repeat_ngram,
    apply_presence_frequency,
    apply_repetition_penalty,
    pad_histories,
    suppress_tokens,
)
from pagedgen.sampling.streams import RequestSampler, stream_uniforms
from pagedgen.sampling.warpers import warp


@dataclass(slots=True)
class SampleRow:
    """One logits row of a step and the request state its processors read."""

    sampler: RequestSampler
    tokens: Sequence[int]  # the request's whole logical sequence so far (prompt + generated + continuations)
    num_prompt_tokens: int  # tokens[:num_prompt_tokens] are the first turn's inputs
    generated: Sequence[int]  # tokens generated so far across the request (presence / frequency penalties)
    turn_generated: int  # tokens generated in the current turn (min_new_tokens)
    eos_token_ids: tuple[int, ...]
    num_logprobs: int = 0  # 0 = no logprobs; n > 0 = sampled logprob + top-n


@dataclass(slots=True)
class SampledToken:
    token: int
    logprob: float | None = None  # None when num_logprobs == 0
    top_logprobs: tuple[tuple[int, float], ...] = ()  # top-n (token, logprob), descending


def inverse_cdf_sample(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw one token per row of ``logits [S, V]`` from ``uniforms [S]`` (float64 in [0, 1)).  # [S] int64

    Probabilities are sorted by descending value (stable, so ties keep vocab order) and accumulated in
    float64; the token is the first whose cumulative probability exceeds ``u * total`` (so the float32
    softmax need not sum to exactly 1). Zero-probability (filtered) tokens are never chosen, even when
    rounding pushes ``u * total`` onto the last cumulative value.
    """
    probs = torch.softmax(logits.float(), dim=-1)  # [S, V]
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)  # [S, V]
    cdf = sorted_p.double().cumsum(dim=-1)  # [S, V]
    target = uniforms.to(cdf)[:, None] * cdf[:, -1:]  # [S, 1]
    pos = torch.searchsorted(cdf, target, right=True)  # [S, 1]
    last_positive = (sorted_p > 0).sum(dim=-1, keepdim=True) - 1  # [S, 1]
    return order.gather(1, torch.minimum(pos, last_positive)).squeeze(1)


def _bad_rows(logits: torch.Tensor) -> torch.Tensor:
    """Rows that cannot be sampled: a NaN or +inf, or no finite logit at all.  # [R] bool"""
    return logits.isnan().any(dim=-1) | (logits == float("inf")).any(dim=-1) | ~logits.isfinite().any(dim=-1)


def process_logits(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Apply every row's logits processors (float32); returns ``logits`` itself when no row has any.

    The processors run on the rows that use them, in this order: EOS suppression under ``min_length``
    (whole sequence) / ``min_new_tokens`` (this turn), repetition penalty, no-repeat n-gram (one call per
    distinct n), presence / frequency penalties, logit bias. The caller's tensor is never modified.
    """
    options = [row.sampler.options for row in rows]
    vocab = logits.shape[1]
    x = logits.float()
    eos_rows, eos_ids = [], []
    for r, (row, o) in enumerate(zip(rows, options, strict=True)):
        if len(row.tokens) < o.min_length or row.turn_generated < o.min_new_tokens:
            eos = [e for e in row.eos_token_ids if e < vocab]
            eos_rows += [r] * len(eos)
            eos_ids += eos
    rep = [r for r, o in enumerate(options) if o.repetition_penalty != 1.0]
    ngram_sizes = sorted({o.no_repeat_ngram_size for o in options if o.no_repeat_ngram_size > 0})
    pen = [r for r, o in enumerate(options) if o.uses_generated]
    bias = [(r, t, b) for r, o in enumerate(options) for t, b in o.logit_bias]
    if not (eos_rows or rep or ngram_sizes or pen or bias):
        return x
    if x is logits:
        x = x.clone()  # the caller may still need its logits
    x = suppress_tokens(x, eos_rows, eos_ids)
    if rep:
        hist, _ = pad_histories([rows[r].tokens for r in rep], vocab, device=x.device)
        sub = apply_repetition_penalty(x[rep], hist, [options[r].repetition_penalty for r in rep])
        x[rep] = sub
    for n in ngram_sizes:
        group = [r for r, o in enumerate(options) if o.no_repeat_ngram_size == n]
        hist, lengths = pad_histories([rows[r].tokens for r in group], -1, left=True, device=x.device)
        x[group] = apply_no_repeat_ngram(x[group], hist, lengths, n)
    if pen:
        gen, _ = pad_histories([rows[r].generated for r in pen], vocab, device=x.device)
        pres = [options[r].presence_penalty for r in pen]
        freq = [options[r].frequency_penalty for r in pen]
        x[pen] = apply_presence_frequency(x[pen], gen, pres, freq)
    if bias:
        rows_b, toks_b, vals_b = (list(col) for col in zip(*bias, strict=True))
        x = apply_logit_bias(x, rows_b, toks_b, vals_b)
    return x


class Sampler:
    """Stateless batched sampler (all per-request state lives in each row's :class:`RequestSampler`)."""

    def sample(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[SampledToken]:
        """Sample one token per row of ``logits [R, vocab]``; ``logits`` is never modified.

        Advances the :class:`RequestSampler` of every row that drew a random number (non-greedy rows); two
        rows of the same request draw consecutive numbers in row order. Raises :class:`SamplingError`,
        changing nothing, on a shape mismatch, a bad row field, or a row with no sampleable token.
        """
        self._validate(logits, rows)
        options = [row.sampler.options for row in rows]
        x = process_logits(logits, rows)  # [R, V] float32
        sampled = [r for r, o in enumerate(options) if not o.is_greedy]
        greedy = [r for r, o in enumerate(options) if o.is_greedy]
        if not sampled:
            self._raise_on_bad(_bad_rows(x))
            tokens = x.argmax(dim=-1)  # [R]
            return self._finish(x, tokens, rows, [], [])
        s_idx = torch.tensor(sampled, device=x.device)
        y = warp(
            x.index_select(0, s_idx),
            [options[r].temperature for r in sampled],
            [options[r].top_k for r in sampled],
            [options[r].top_p for r in sampled],
            [options[r].min_p for r in sampled],
        )  # [S, V]
        bad = torch.zeros(len(rows), dtype=torch.bool, device=x.device)
        bad[s_idx] = _bad_rows(y)
        tokens = torch.empty(len(rows), dtype=torch.int64, device=x.device)  # [R]
        if greedy:
            g_idx = torch.tensor(greedy, device=x.device)
            g_x = x.index_select(0, g_idx)
            bad[g_idx] = _bad_rows(g_x)
            tokens[g_idx] = g_x.argmax(dim=-1)
        self._raise_on_bad(bad)
        draws = self._draw_counters(rows, sampled)
        u = torch.from_numpy(stream_uniforms([rows[r].sampler.seed for r in sampled], draws))  # [S]
        tokens[s_idx] = inverse_cdf_sample(y, u.to(x.device))
        if any(row.num_logprobs > 0 for row in rows):
            x = x.index_copy(0, s_idx, y)
        return self._finish(x, tokens, rows, sampled, draws)

    def _finish(
        self,
        processed: torch.Tensor,
        tokens: torch.Tensor,
        rows: Sequence[SampleRow],
        sampled: list[int],
        draws: list[int],
    ) -> list[SampledToken]:
        """Logprobs, one host copy of the tokens, then (nothing can fail any more) advance the streams."""
        logprobs = compute_logprobs(processed, tokens, [row.num_logprobs for row in rows])
        token_list = tokens.tolist()
        for r in sampled:
            rows[r].sampler.advance()
        out = []
        for token, lp in zip(token_list, logprobs, strict=True):
            out.append(SampledToken(token) if lp is None else SampledToken(token, lp.logprob, lp.top))
        return out

    @staticmethod
    def _draw_counters(rows: Sequence[SampleRow], sampled: list[int]) -> list[int]:
        """Each sampled row's draw index: its sampler's count plus earlier rows of the same request."""
        seen: dict[int, int] = {}
        draws = []
        for r in sampled:
            sampler = rows[r].sampler
            k = seen.get(id(sampler), 0)
            seen[id(sampler)] = k + 1
            draws.append(sampler.draws + k)
        return draws

    @staticmethod
    def _raise_on_bad(bad: torch.Tensor) -> None:
        if bool(bad.any()):
            first = int(bad.nonzero()[0, 0])
            raise SamplingError(
                f"logits row {first} has no sampleable token (NaN, +inf, or every token filtered / banned)"
            )

    @staticmethod
    def _validate(logits: torch.Tensor, rows: Sequence[SampleRow]) -> None:
        if logits.dim() != 2 or not logits.is_floating_point():
            raise SamplingError(f"logits must be a 2-D float tensor [rows, vocab], got {tuple(logits.shape)}")
        if logits.shape[0] != len(rows) or not rows:
            raise SamplingError(f"got {logits.shape[0]} logits rows for {len(rows)} sample rows (need >= 1)")
        vocab = logits.shape[1]
        for r, row in enumerate(rows):
            if not isinstance(row.sampler, RequestSampler):
                raise SamplingError(f"row {r}: sampler must be a RequestSampler, got {type(row.sampler)}")
            if not 0 <= row.num_prompt_tokens <= len(row.tokens):
                raise SamplingError(
                    f"row {r}: num_prompt_tokens={row.num_prompt_tokens} not in [0, {len(row.tokens)}]"
                )
            if row.turn_generated < 0 or row.num_logprobs < 0:
                raise SamplingError(
                    f"row {r}: turn_generated={row.turn_generated} and num_logprobs={row.num_logprobs} "
                    "must be >= 0"
                )
            if any(e < 0 for e in row.eos_token_ids):
                raise SamplingError(f"row {r}: eos_token_ids={row.eos_token_ids} must be >= 0")
            bias = row.sampler.options.logit_bias
            if bias and max(t for t, _ in bias) >= vocab:
                raise SamplingError(f"row {r}: logit_bias names a token id >= vocab size {vocab}")
