"""Logits processors that read a request's history, vectorised over the rows of a step.

Each function takes a logits block ``[R, V]`` (float32) plus one parameter per row and returns a NEW tensor;
nothing is mutated. Each equals the transformers processor of the same name applied to that row alone
(``RepetitionPenaltyLogitsProcessor``, ``NoRepeatNGramLogitsProcessor``, ``MinLength`` /
``MinNewTokensLengthLogitsProcessor``): the same float32 operations in the same order, so the results are
bitwise equal, and each row's result depends only on that row (batch invariance). Presence / frequency
penalties and logit bias follow OpenAI / vLLM.

Histories travel as padded ``[R, L]`` int64 blocks built by :func:`pad_histories`; ids at or past the vocab
size are clamped to a spare column (as transformers does) because the model can never produce them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pagedgen.sampling.errors import SamplingError


def pad_histories(
    seqs: Sequence[Sequence[int]], pad: int, *, left: bool = False, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack token sequences into one padded block: ``(ids [R, L] int64, lengths [R] int64)``.

    ``left=True`` right-aligns every sequence (padding first), which the n-gram ban needs so that every row's
    most recent tokens share the same columns. Raises :class:`SamplingError` on a negative token id.
    """
    arrays = [np.asarray(s, dtype=np.int64).reshape(-1) for s in seqs]
    lengths = np.fromiter((a.shape[0] for a in arrays), dtype=np.int64, count=len(arrays))  # [R]
    width = max(int(lengths.max(initial=0)), 1)
    out = np.full((len(arrays), width), pad, dtype=np.int64)  # [R, L]
    if lengths.sum() > 0:
        flat = np.concatenate(arrays)  # [sum(lengths)]
        if flat.min() < 0:
            raise SamplingError(f"token histories must hold ids >= 0, found {int(flat.min())}")
        rows = np.repeat(np.arange(len(arrays)), lengths)
        starts = np.cumsum(lengths) - lengths
        cols = np.arange(flat.shape[0]) - np.repeat(starts, lengths)
        if left:
            cols += np.repeat(width - lengths, lengths)
        out[rows, cols] = flat
    return torch.from_numpy(out).to(device), torch.from_numpy(lengths).to(device)


def apply_repetition_penalty(
    logits: torch.Tensor, history: torch.Tensor, penalty: Sequence[float]
) -> torch.Tensor:
    """Transformers' repetition penalty: each token seen in the row's history once, ``< 0 ? x*p : x/p``.

    ``history`` is ``[R, L]`` padded with any id >= V (it lands in the spare column and is dropped).
    """
    vocab = logits.shape[-1]
    p = torch.tensor(penalty, dtype=logits.dtype, device=logits.device)[:, None]  # [R, 1]
    ids = history.clamp(max=vocab)  # [R, L]
    padded = torch.nn.functional.pad(logits, (0, 1))  # [R, V + 1]
    score = padded.gather(1, ids)  # [R, L]
    score = torch.where(score < 0, score * p, score / p)
    return padded.scatter(1, ids, score)[:, :vocab]


def apply_no_repeat_ngram(
    logits: torch.Tensor, history: torch.Tensor, lengths: torch.Tensor, ngram_size: int
) -> torch.Tensor:
    """Transformers' no-repeat n-gram ban for rows that share one ``ngram_size``.

    Bans (sets to -inf) every token that would complete an n-gram already present in the row's history.
    ``history`` must be LEFT padded with -1 (:func:`pad_histories` with ``left=True``), so the current
    (n-1)-token prefix of every row sits in the last columns; windows that touch padding never match.
    """
    vocab = logits.shape[-1]
    width = history.shape[1]
    if ngram_size <= 0 or width < ngram_size:
        return logits
    prefix = history[:, width + 1 - ngram_size :]  # [R, n-1]
    windows = history.unfold(1, ngram_size, 1)  # [R, W, n], W = L - n + 1
    matches = (windows[..., :-1] == prefix[:, None, :]).all(dim=-1)  # [R, W]
    matches &= windows[..., 0] >= 0  # a window is real iff its first token is (left padding)
    matches &= (lengths >= ngram_size)[:, None]
    banned = torch.zeros((logits.shape[0], vocab + 1), dtype=torch.bool, device=logits.device)
    target = torch.where(matches, windows[..., -1].clamp(max=vocab), vocab)  # [R, W]
    banned.scatter_(1, target, True)
    return logits.masked_fill(banned[:, :vocab], -float("inf"))


def apply_presence_frequency(
    logits: torch.Tensor, generated: torch.Tensor, presence: Sequence[float], frequency: Sequence[float]
) -> torch.Tensor:
    """OpenAI / vLLM penalties over generated tokens: ``x - frequency * count - presence * (count > 0)``.

    ``generated`` is ``[R, G]`` padded with any id >= V.
    """
    vocab = logits.shape[-1]
    ids = generated.clamp(max=vocab)  # [R, G]
    counts = torch.zeros((logits.shape[0], vocab + 1), dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=logits.dtype))
    counts = counts[:, :vocab]  # [R, V]
    freq = torch.tensor(frequency, dtype=logits.dtype, device=logits.device)[:, None]  # [R, 1]
    pres = torch.tensor(presence, dtype=logits.dtype, device=logits.device)[:, None]  # [R, 1]
    return logits - freq * counts - pres * (counts > 0).to(logits.dtype)


def apply_logit_bias(
    logits: torch.Tensor, rows: Sequence[int], tokens: Sequence[int], bias: Sequence[float]
) -> torch.Tensor:
    """Add ``bias[i]`` to ``logits[rows[i], tokens[i]]`` (the (row, token) pairs must be distinct)."""
    if not rows:
        return logits
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(tokens, device=device))
    values = logits[index] + torch.tensor(bias, dtype=logits.dtype, device=device)
    return logits.index_put(index, values)


def suppress_tokens(logits: torch.Tensor, rows: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
    """Set ``logits[rows[i], tokens[i]]`` to -inf: EOS under a minimum length (transformers' MinLength and
    MinNewTokensLength processors, which compare the length with ``<`` and ban every EOS id)."""
    if not rows:
        return logits
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(tokens, device=device))
    return logits.index_put(index, torch.tensor(-float("inf"), dtype=logits.dtype, device=device))
