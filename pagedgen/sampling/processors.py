"""Logits processors that read a request's history, vectorised over the rows of a step.

Each ``apply_*_`` function updates the rows ``rows`` of a float32 logits block ``[R, V]`` IN PLACE (the
sampler owns a working copy), touching only the (row, token) pairs that change: a step costs O(history),
not O(rows x vocab). Each equals the transformers processor of the same name applied to that row alone
(``RepetitionPenaltyLogitsProcessor``, ``NoRepeatNGramLogitsProcessor``, ``MinLength`` /
``MinNewTokensLengthLogitsProcessor``): the same float32 operations on the same values, so results are
bitwise equal, and each row's result depends only on that row (batch invariance). Presence / frequency
penalties and logit bias follow OpenAI / vLLM (``x - frequency * count - presence * (count > 0)``).

Token ids at or past the vocab size are ignored (transformers clamps them to a dropped spare column),
because the model can never produce them. Negative ids raise :class:`SamplingError` before any change.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pagedgen.core.transfer import upload_values
from pagedgen.errors import SamplingError

_NEG_INF = -float("inf")


def _flatten(seqs: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """All ids of ``seqs`` in one array and the length of each: ``(flat [N], lengths [R])``."""
    arrays = [np.asarray(s, dtype=np.int64).reshape(-1) for s in seqs]
    lengths = np.fromiter((a.shape[0] for a in arrays), dtype=np.int64, count=len(arrays))  # [R]
    flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)  # [N]
    if flat.size and flat.min() < 0:
        raise SamplingError(f"token histories must hold ids >= 0, found {int(flat.min())}")
    return flat, lengths


def distinct_pairs(seqs: Sequence[Sequence[int]], vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct ``(position in seqs, token)`` pairs with token < vocab and how often each occurs.

    Returns ``(positions [P], tokens [P], counts [P])`` as numpy int64 arrays (histories live on the host).
    """
    flat, lengths = _flatten(seqs)
    position = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)  # [N]
    keep = flat < vocab
    keys, counts = np.unique(position[keep] * vocab + flat[keep], return_counts=True)  # [P]
    return keys // vocab, keys % vocab, counts


def pad_histories(
    seqs: Sequence[Sequence[int]], pad: int, *, left: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Pack token sequences into one padded host block: ``(ids [R, L] int64, lengths [R] int64)``.

    ``left=True`` right-aligns every sequence (padding first), which the n-gram ban needs so that every row's
    most recent tokens share the same columns.
    """
    flat, lengths = _flatten(seqs)
    width = max(int(lengths.max(initial=0)), 1)
    out = np.full((len(lengths), width), pad, dtype=np.int64)  # [R, L]
    if flat.size:
        rows = np.repeat(np.arange(len(lengths)), lengths)
        cols = np.arange(flat.shape[0]) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        if left:
            cols += np.repeat(width - lengths, lengths)
        out[rows, cols] = flat
    return out, lengths


def _index(rows: Sequence[int], positions: np.ndarray, tokens: np.ndarray, device: torch.device):
    row_of = upload_values(np.asarray(rows, dtype=np.int64)[positions], torch.long, device)  # [P]
    return row_of, upload_values(tokens, torch.long, device)


def _per_pair(values: Sequence[float], positions: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    per_row = upload_values(values, like.dtype, like.device)  # [len(rows)]
    return per_row[upload_values(positions, torch.long, like.device)]  # [P]


def apply_repetition_penalty_(
    logits: torch.Tensor, rows: Sequence[int], histories: Sequence[Sequence[int]], penalty: Sequence[float]
) -> None:
    """Transformers' repetition penalty, in place: each token seen in the row's history, once,
    becomes ``x * p`` if ``x < 0`` else ``x / p``."""
    positions, tokens, _ = distinct_pairs(histories, logits.shape[-1])
    index = _index(rows, positions, tokens, logits.device)
    p = _per_pair(penalty, positions, logits)  # [P]
    score = logits[index]  # [P]
    logits[index] = torch.where(score < 0, score * p, score / p)


def apply_presence_frequency_(
    logits: torch.Tensor,
    rows: Sequence[int],
    generated: Sequence[Sequence[int]],
    presence: Sequence[float],
    frequency: Sequence[float],
) -> None:
    """OpenAI / vLLM penalties over generated tokens, in place: ``x - frequency * count - presence``
    for every token generated ``count >= 1`` times (the others are unchanged)."""
    positions, tokens, counts = distinct_pairs(generated, logits.shape[-1])
    index = _index(rows, positions, tokens, logits.device)
    count = upload_values(counts, torch.long, logits.device).to(logits.dtype)  # [P]
    freq = _per_pair(frequency, positions, logits)
    pres = _per_pair(presence, positions, logits)
    logits[index] = logits[index] - freq * count - pres


def apply_no_repeat_ngram_(
    logits: torch.Tensor, rows: Sequence[int], histories: Sequence[Sequence[int]], ngram_size: int
) -> None:
    """Transformers' no-repeat n-gram ban for rows sharing one ``ngram_size``, in place: -inf for every
    token that would complete an n-gram already present in the row's history.

    Histories are right-aligned (left padding with -1) so that each row's current (n-1)-token prefix sits
    in the last columns; windows that touch padding never match. The matching runs on the host, where the
    histories are: which tokens to ban depends on the histories only, so the device gets their indices in
    one upload and nothing is read back (a ``nonzero`` on the device would wait for it).
    """
    history, lengths = pad_histories(histories, -1, left=True)  # [G, L], [G]
    width = history.shape[1]
    if ngram_size <= 0 or width < ngram_size:
        return
    prefix = history[:, width + 1 - ngram_size :]  # [G, n-1]
    windows = np.lib.stride_tricks.sliding_window_view(history, ngram_size, axis=1)  # [G, L - n + 1, n]
    matches = windows[..., 0] >= 0  # [G, W]: a window is real iff its first token is (left padding)
    for k in range(ngram_size - 1):  # column by column: no [G, W, n-1] temporary
        matches &= windows[..., k] == prefix[:, k : k + 1]
    matches &= (lengths >= ngram_size)[:, None]
    matches &= windows[..., -1] < logits.shape[-1]
    group, window = np.nonzero(matches)  # [P], [P]
    if not group.size:
        return
    banned = np.concatenate([np.asarray(rows, dtype=np.int64)[group], windows[group, window, -1]])  # [2P]
    row_of, tokens = upload_values(banned, torch.long, logits.device).split(group.size)
    logits[row_of, tokens] = _NEG_INF


def apply_logit_bias_(
    logits: torch.Tensor, rows: Sequence[int], tokens: Sequence[int], bias: Sequence[float]
) -> None:
    """Add ``bias[i]`` to ``logits[rows[i], tokens[i]]`` in place ((row, token) pairs must be distinct)."""
    if not rows:
        return
    device = logits.device
    index = (upload_values(rows, torch.long, device), upload_values(tokens, torch.long, device))
    logits[index] = logits[index] + upload_values(bias, logits.dtype, device)


def suppress_tokens_(logits: torch.Tensor, rows: Sequence[int], tokens: Sequence[int]) -> None:
    """Set ``logits[rows[i], tokens[i]]`` to -inf in place: EOS under a minimum length (transformers'
    MinLength and MinNewTokensLength processors, which compare the length with ``<`` and ban every EOS)."""
    if not rows:
        return
    device = logits.device
    logits[upload_values(rows, torch.long, device), upload_values(tokens, torch.long, device)] = _NEG_INF
