"""The batched sampler: one call turns a step's logits rows into tokens, each row with its own settings.

Pipeline for a step (every stage vectorised over the rows that need it; rows that do not are untouched):

1. processors (all rows): the guidance token mask (rows that have one, :mod:`pagedgen.guidance.bitmask`),
   EOS suppression under min_length / min_new_tokens, repetition penalty, no-repeat
   n-gram, presence / frequency penalties, logit bias (:mod:`pagedgen.sampling.processors`);
2. greedy rows: argmax of the processed logits (first index on ties, as ``torch.argmax`` / transformers);
3. sampled rows: temperature, top-k, top-p, min-p (:mod:`pagedgen.sampling.warpers`), then one uniform from
   the request's counter-based stream (:mod:`pagedgen.sampling.streams`) is mapped through the inverse CDF of
   the processed distribution (vocabulary order, :func:`inverse_cdf_sample`);
4. logprobs for rows that asked (:mod:`pagedgen.sampling.logprobs`);
5. only then, each sampled row's :class:`RequestSampler` advances by one draw.

Every row's float math is row-wise (softmax, sort, cumsum along the vocab), so a request's token depends only
on its own logits, settings, seed and draw count: never on its neighbours, its row or the batch size. Anything
that would make the call fail is detected before step 5, so a refused call changes no sampler state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedgen.core.transfer import upload_values
from pagedgen.errors import RowSamplingError, SamplingError
from pagedgen.guidance.bitmask import TokenMasks, apply_token_bitmask_
from pagedgen.sampling.logprobs import LogprobTensors, logprob_tensors
from pagedgen.sampling.processors import (
    apply_logit_bias_,
    apply_no_repeat_ngram_,
    apply_presence_frequency_,
    apply_repetition_penalty_,
    suppress_tokens_,
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


_CDF_BLOCK = 256  # tokens per block of the two-level inverse CDF (a power of two, for _tree_sum)


def _last_positive(mass: torch.Tensor) -> torch.Tensor:
    """Index of the last positive entry along the last dim (0 if none).  # [..., 1]"""
    positive = (mass > 0).flip(-1).to(torch.uint8)
    return mass.shape[-1] - 1 - positive.argmax(dim=-1, keepdim=True)


def _tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (a power of two) by a fixed binary tree of elementwise adds.  # [...]

    A reduction kernel may pick its summation order from the tensor's shape (on CUDA, from the number of
    rows); elementwise adds cannot, so a block's mass is bitwise the same in any batch on any device.
    """
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x.squeeze(-1)


def inverse_cdf_sample(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw one token per row of ``logits [S, V]`` from ``uniforms [S]`` (float64 in [0, 1)).  # [S] int64

    Inverse CDF in vocabulary order, two-level so that no full sort or full-vocab float64 pass is needed
    (a sort of a 50k vocabulary dominates a CPU step): the float64 running sum of the masses of blocks of
    ``_CDF_BLOCK`` tokens picks the block where the cumulative probability first exceeds ``u * total``, a
    float64 cumulative sum inside that one block picks the token. (Block masses are float32 sums, as exact
    as the float32 softmax they add up.) Every operation is row-wise, so a row's token depends only on its own
    logits and uniform. Zero-probability (filtered) tokens are never chosen, even when rounding pushes the
    target onto a block's or the row's upper end.
    """
    rows, vocab = logits.shape
    probs = torch.softmax(logits.float(), dim=-1)  # [S, V]
    num_blocks = -(-vocab // _CDF_BLOCK)
    if num_blocks * _CDF_BLOCK != vocab:
        probs = torch.nn.functional.pad(probs, (0, num_blocks * _CDF_BLOCK - vocab))
    blocks = probs.view(rows, num_blocks, _CDF_BLOCK)  # [S, NB, B]
    mass = _tree_sum(blocks).double()  # [S, NB]
    cdf = mass.cumsum(dim=-1)  # [S, NB]
    target = uniforms.to(cdf)[:, None] * cdf[:, -1:]  # [S, 1]
    block = torch.searchsorted(cdf, target, right=True)  # [S, 1]
    block = torch.minimum(block, _last_positive(mass))
    before = torch.nn.functional.pad(cdf, (1, 0)).gather(1, block)  # [S, 1], mass of the earlier blocks
    inner = blocks.gather(1, block[:, :, None].expand(rows, 1, _CDF_BLOCK)).squeeze(1)  # [S, B]
    inner_cdf = inner.double().cumsum(dim=-1)  # [S, B]
    offset = torch.searchsorted(inner_cdf, target - before, right=True)  # [S, 1]
    offset = torch.minimum(offset, _last_positive(inner))
    return (block * _CDF_BLOCK + offset).squeeze(1)


def _bad_rows(logits: torch.Tensor) -> torch.Tensor:
    """Rows that cannot be sampled: a NaN, a +inf, or no finite logit (the row max propagates NaN).  # [R]"""
    return ~torch.isfinite(logits.amax(dim=-1))


def _host_argmax(x: torch.Tensor) -> list[SampledToken]:
    """Every row greedy, on the CPU, no logprobs: the argmax of each row, read through numpy.

    Why: ``torch.argmax`` and ``amax`` over a 49k-262k vocabulary cost hundreds of microseconds on one
    core (and more when a second thread must wake up), numpy's vectorised argmax a few tens. The token is
    the same (the first index of the maximum, as ``torch.argmax``), and so is the refusal: a row is bad
    exactly when the value at its argmax is not finite (numpy's argmax stops at the first NaN, so a NaN,
    a +inf or an all ``-inf`` row lands there), which is :func:`_bad_rows`'s row max test.
    """
    values = x.detach().numpy()  # [R, V], the tensor's own memory
    tokens = values.argmax(axis=-1)  # [R]
    best = values[np.arange(values.shape[0]), tokens]  # [R]
    Sampler._raise_on_bad((~np.isfinite(best)).tolist())
    return [SampledToken(token) for token in tokens.tolist()]


def process_logits(
    logits: torch.Tensor, rows: Sequence[SampleRow], masks: TokenMasks | None = None
) -> torch.Tensor:
    """Apply every row's logits processors (float32); returns ``logits`` itself when no row has any.

    The processors run on the rows that use them, in this order: the
    guidance mask of the rows ``masks`` names (first: every later processor sees only allowed tokens), EOS
    suppression under ``min_length`` (whole sequence) / ``min_new_tokens`` (this turn), repetition penalty,
    no-repeat n-gram (one call per distinct n), presence / frequency penalties, logit bias. The caller's
    tensor is never modified.
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
    guided = masks is not None and masks.rows.numel() > 0
    if not (guided or eos_rows or rep or ngram_sizes or pen or bias):
        return x
    if x is logits:
        x = x.clone()  # the caller may still need its logits; the processors below work in place
    if guided:
        apply_token_bitmask_(x, masks)
    suppress_tokens_(x, eos_rows, eos_ids)
    if rep:
        penalties = [options[r].repetition_penalty for r in rep]
        apply_repetition_penalty_(x, rep, [rows[r].tokens for r in rep], penalties)
    for n in ngram_sizes:
        group = [r for r, o in enumerate(options) if o.no_repeat_ngram_size == n]
        apply_no_repeat_ngram_(x, group, [rows[r].tokens for r in group], n)
    if pen:
        pres = [options[r].presence_penalty for r in pen]
        freq = [options[r].frequency_penalty for r in pen]
        apply_presence_frequency_(x, pen, [rows[r].generated for r in pen], pres, freq)
    if bias:
        rows_b, toks_b, vals_b = (list(col) for col in zip(*bias, strict=True))
        apply_logit_bias_(x, rows_b, toks_b, vals_b)
    return x


class Sampler:
    """Stateless batched sampler (all per-request state lives in each row's :class:`RequestSampler`)."""

    def sample(
        self, logits: torch.Tensor, rows: Sequence[SampleRow], masks: TokenMasks | None = None
    ) -> list[SampledToken]:
        """Sample one token per row of ``logits [R, vocab]``; ``logits`` is never modified.

        ``masks``: guidance token masks of some rows, applied before every other processor.

        Advances the :class:`RequestSampler` of every row that drew a random number (non-greedy rows); two
        rows of the same request draw consecutive numbers in row order. Raises :class:`SamplingError`,
        changing nothing, on a shape mismatch, a bad row field, or a row with no sampleable token.

        Host traffic: the call reads the device once (:meth:`_read_back`: tokens, bad-row flags and logprobs
        in one copy) and refuses a bad row from that copy, before any stream advances.
        """
        self._validate(logits, rows)
        x = process_logits(logits, rows, masks)  # [R, V] float32
        device = x.device
        sampled = [r for r, row in enumerate(rows) if not row.sampler.options.is_greedy]
        if not sampled and x.device.type == "cpu" and not any(row.num_logprobs > 0 for row in rows):
            return _host_argmax(x)
        draws = self._draw_counters(rows, sampled)
        if not sampled:
            tokens, bad = x.argmax(dim=-1), _bad_rows(x)  # [R], [R]
        else:
            everyone = len(sampled) == len(rows)
            s_idx = None if everyone else upload_values(sampled, torch.long, device)  # [S]
            y = self._warp(x if s_idx is None else x.index_select(0, s_idx), rows, sampled)  # [S, V]
            u = upload_values(
                stream_uniforms([rows[r].sampler.seed for r in sampled], draws), torch.float64, device
            )
            drawn = inverse_cdf_sample(y, u)  # [S]
            if s_idx is None:
                tokens, bad = drawn, _bad_rows(y)
            else:
                tokens, bad = self._greedy_tokens(x, rows)  # [R], [R]
                tokens[s_idx] = drawn
                bad[s_idx] = _bad_rows(y)
            if any(row.num_logprobs > 0 for row in rows):  # logprobs of sampled rows: the warped distribution
                x = y if s_idx is None else x.index_copy(0, s_idx, y)
        return self._finish(x, tokens, bad, rows, sampled)

    @staticmethod
    def _warp(x: torch.Tensor, rows: Sequence[SampleRow], sampled: list[int]) -> torch.Tensor:
        options = [rows[r].sampler.options for r in sampled]
        return warp(
            x,
            [o.temperature for o in options],
            [o.top_k for o in options],
            [o.top_p for o in options],
            [o.min_p for o in options],
        )

    @staticmethod
    def _greedy_tokens(x: torch.Tensor, rows: Sequence[SampleRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """Argmax tokens for the greedy rows (others left for the draw) and which greedy rows are bad."""
        tokens = torch.zeros(len(rows), dtype=torch.int64, device=x.device)  # [R]
        bad = torch.zeros(len(rows), dtype=torch.bool, device=x.device)  # [R]
        greedy = [r for r, row in enumerate(rows) if row.sampler.options.is_greedy]
        if greedy:
            g_idx = upload_values(greedy, torch.long, x.device)  # [G]
            g_x = x.index_select(0, g_idx)  # [G, V]
            bad[g_idx] = _bad_rows(g_x)
            tokens[g_idx] = g_x.argmax(dim=-1)
        return tokens, bad

    def _finish(
        self,
        processed: torch.Tensor,
        tokens: torch.Tensor,
        bad: torch.Tensor,
        rows: Sequence[SampleRow],
        sampled: list[int],
    ) -> list[SampledToken]:
        """One host copy of the tokens, bad-row flags and logprobs; refuse a bad row from it; then (nothing
        can fail any more) advance the streams."""
        num_logprobs = [row.num_logprobs for row in rows]
        logprobs = None
        if any(num_logprobs):  # a bad row's token may lie past the vocab: keep its gather in range
            logprobs = logprob_tensors(processed, tokens.clamp(max=processed.shape[-1] - 1), num_logprobs)
        host = self._read_back(tokens, bad, logprobs)
        n = len(rows)
        token_list, bad_list = host[:n], host[n : 2 * n]
        self._raise_on_bad(bad_list)
        for r in sampled:
            rows[r].sampler.advance()
        if logprobs is None:
            return [SampledToken(int(token)) for token in token_list]
        per_row = logprobs.rows(host[2 * n :], num_logprobs, processed.shape[-1])
        return [
            SampledToken(int(token)) if lp is None else SampledToken(int(token), lp.logprob, lp.top)
            for token, lp in zip(token_list, per_row, strict=True)
        ]

    @staticmethod
    def _read_back(tokens: torch.Tensor, bad: torch.Tensor, logprobs: LogprobTensors | None) -> list:
        """The step's one device-to-host copy: ``[tokens, bad flags, logprob parts]`` as one flat list.

        Without logprobs it stays int64 (tokens, then 0/1 flags); with them everything is float64, which
        holds token ids (< 2**53) and float32 logprobs exactly, so the values are those separate copies
        would have given.
        """
        if logprobs is None:
            return torch.cat([tokens, bad.to(torch.int64)]).tolist()
        parts = [tokens, bad, *logprobs.parts]
        return torch.cat([part.to(torch.float64) for part in parts]).tolist()

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
    def _raise_on_bad(bad: Sequence[int | float]) -> None:
        """Refuse the call, from the host copy of the bad-row flags, naming the first bad row."""
        if any(bad):
            first = next(r for r, flag in enumerate(bad) if flag)
            raise RowSamplingError(
                f"logits row {first} has no sampleable token (NaN, +inf, or every token filtered / banned)",
                first,
            )

    @staticmethod
    def _validate(logits: torch.Tensor, rows: Sequence[SampleRow]) -> None:
        if logits.dim() != 2 or not logits.is_floating_point():
            raise SamplingError(f"logits must be a 2-D float tensor [rows, vocab], got {tuple(logits.shape)}")
        if logits.shape[0] != len(rows) or not rows:
            raise SamplingError(f"got {logits.shape[0]} logits rows for {len(rows)} sample rows (need >= 1)")
        vocab = logits.shape[1]
        for r, row in enumerate(rows):
            problem = _row_problem(row, vocab)
            if problem is not None:
                raise RowSamplingError(f"row {r}: {problem}", r)


def _row_problem(row: SampleRow, vocab: int) -> str | None:
    """What makes ``row`` unsampleable with a ``vocab``-wide logits row, or None."""
    if not isinstance(row.sampler, RequestSampler):
        return f"sampler must be a RequestSampler, got {type(row.sampler)}"
    if not 0 <= row.num_prompt_tokens <= len(row.tokens):
        return f"num_prompt_tokens={row.num_prompt_tokens} not in [0, {len(row.tokens)}]"
    if row.turn_generated < 0 or row.num_logprobs < 0:
        return f"turn_generated={row.turn_generated} and num_logprobs={row.num_logprobs} must be >= 0"
    if any(e < 0 for e in row.eos_token_ids):
        return f"eos_token_ids={row.eos_token_ids} must be >= 0"
    bias = row.sampler.options.logit_bias
    if bias and max(t for t, _ in bias) >= vocab:
        return f"logit_bias names a token id >= vocab size {vocab}"
    return None
