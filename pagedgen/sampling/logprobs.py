"""Log-probabilities of sampled tokens and their top-n alternatives.

They are taken from the PROCESSED distribution, the one the token was actually drawn from (vLLM's
``logprobs_mode="processed_logprobs"``): after EOS suppression, repetition / presence / frequency penalties,
n-gram bans and logit bias, and, for sampled rows, after temperature and top-k / top-p / min-p filtering.
Greedy rows use the processed logits without warpers (greedy decoding ignores them, as in transformers), so
their chosen token always carries the maximum logprob. Filtered tokens have probability 0 (logprob -inf); they
are never sampled and are left out of the alternatives, so a row may get fewer than n of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class RowLogprobs:
    """One row's sampled-token logprob and its top-n ``(token, logprob)`` alternatives, descending."""

    logprob: float
    top: tuple[tuple[int, float], ...]


def compute_logprobs(
    processed: torch.Tensor, tokens: torch.Tensor, num_logprobs: Sequence[int]
) -> list[RowLogprobs | None]:
    """Logprobs for every row with ``num_logprobs[r] > 0`` (None for the others).

    ``processed`` is ``[R, V]``, ``tokens`` ``[R]`` int64 on the same device. One log-softmax, one gather and
    one top-k over the rows that asked, one device-to-host copy; nothing is mutated.
    """
    wanted = [r for r, n in enumerate(num_logprobs) if n > 0]
    result: list[RowLogprobs | None] = [None] * len(num_logprobs)
    if not wanted:
        return result
    vocab = processed.shape[-1]
    index = torch.tensor(wanted, device=processed.device)  # [W]
    logp = torch.log_softmax(processed.index_select(0, index).float(), dim=-1)  # [W, V]
    chosen = logp.gather(1, tokens.index_select(0, index)[:, None]).squeeze(1)  # [W]
    n_max = min(max(num_logprobs), vocab)
    top = torch.topk(logp, n_max, dim=-1)  # values/indices [W, n_max], descending
    chosen_l, values_l, ids_l = chosen.tolist(), top.values.tolist(), top.indices.tolist()
    for i, r in enumerate(wanted):
        n = min(num_logprobs[r], vocab)
        pairs = zip(ids_l[i][:n], values_l[i][:n], strict=True)
        top = tuple((t, v) for t, v in pairs if v != -float("inf"))
        result[r] = RowLogprobs(chosen_l[i], top)
    return result
