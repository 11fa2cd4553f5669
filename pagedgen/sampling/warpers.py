"""Distribution warpers for sampled rows: temperature, top-k, top-p, min-p, each with its own value per row.

Applied in transformers' order (temperature -> top-k -> top-p -> min-p). Each function returns a NEW tensor
and, for one row, equals transformers' ``TemperatureLogitsWarper`` / ``TopKLogitsWarper`` /
``TopPLogitsWarper`` / ``MinPLogitsWarper`` (``min_tokens_to_keep=1``) bitwise: the same float32 ops in the
same order, with the per-row scalar rounded to float32 exactly as torch rounds a Python scalar operand. A row
whose value disables the warper (top_k 0, top_p 1, min_p 0) comes back bitwise unchanged, and each row's
result depends only on that row, so mixed settings can share one call without changing any row's tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedgen.core.transfer import upload_values

_NEG_INF = -float("inf")


def _per_row(
    values: Sequence[float] | Sequence[int] | Sequence[bool], like: torch.Tensor, dtype=None
) -> torch.Tensor:
    """``values`` as a ``[R, 1]`` column on ``like``'s device (pinned, asynchronous upload on CUDA)."""
    return upload_values(values, like.dtype if dtype is None else dtype, like.device)[:, None]  # [R, 1]


def apply_temperature(logits: torch.Tensor, temperature: Sequence[float]) -> torch.Tensor:
    """``logits / t`` per row (t > 0; greedy rows never reach a warper)."""
    return logits / _per_row(temperature, logits)


def apply_top_k(logits: torch.Tensor, top_k: Sequence[int]) -> torch.Tensor:
    """Keep each row's ``k`` largest logits (ties with the k-th are kept); ``k <= 0`` keeps everything."""
    vocab = logits.shape[-1]
    ks = [min(k, vocab) if k > 0 else 0 for k in top_k]
    k_max = max(ks, default=0)
    if k_max == 0:
        return logits
    largest = torch.topk(logits, k_max, dim=-1).values  # [R, k_max], descending
    kth_col = _per_row([max(k, 1) - 1 for k in ks], logits, torch.long)  # [R, 1]
    kth = largest.gather(1, kth_col)  # [R, 1]
    enabled = _per_row([k > 0 for k in ks], logits, torch.bool)  # [R, 1]
    kth = torch.where(enabled, kth, torch.full_like(kth, _NEG_INF))
    return logits.masked_fill(logits < kth, _NEG_INF)


def apply_top_p(logits: torch.Tensor, top_p: Sequence[float]) -> torch.Tensor:
    """Nucleus filter: drop the low tail of cumulative probability <= 1 - p; ``p >= 1`` keeps everything.

    As transformers: sort ascending, softmax, cumulative sum, always keep the most likely token.
    """
    if all(p >= 1.0 for p in top_p):
        return logits
    sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=False, stable=True)  # [R, V]
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [R, V]
    remove_sorted = cumulative <= _per_row([1.0 - p for p in top_p], logits)
    remove_sorted[:, -1] = False
    enabled = _per_row([p < 1.0 for p in top_p], logits, torch.bool)  # [R, 1]
    remove_sorted &= enabled
    remove = remove_sorted.scatter(1, sorted_idx, remove_sorted)  # back to vocab order
    return logits.masked_fill(remove, _NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: Sequence[float]) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the row's top probability; keeps the top one."""
    if all(m <= 0.0 for m in min_p):
        return logits
    probs = torch.softmax(logits, dim=-1)  # [R, V]
    top = probs.amax(dim=-1, keepdim=True)  # [R, 1]
    remove = probs < _per_row(min_p, logits) * top
    remove.scatter_(1, probs.argmax(dim=-1, keepdim=True), False)
    return logits.masked_fill(remove, _NEG_INF)


def warp(
    logits: torch.Tensor,
    temperature: Sequence[float],
    top_k: Sequence[int],
    top_p: Sequence[float],
    min_p: Sequence[float],
) -> torch.Tensor:
    """All four warpers in transformers' order; skips a warper no row uses, so the common case stays cheap."""
    if any(t != 1.0 for t in temperature):
        logits = apply_temperature(logits, temperature)
    logits = apply_top_k(logits, top_k)
    logits = apply_top_p(logits, top_p)
    return apply_min_p(logits, min_p)
