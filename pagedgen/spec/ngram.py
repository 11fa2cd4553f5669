"""Prompt-lookup (n-gram) drafts: continue the context the way it continued the last time it read the same.

Generation often copies from its own context: a text the prompt asks to repeat, edit or quote, code, names,
lists. Prompt lookup (Saxena 2023; vLLM's ``ngram`` speculative method) finds the latest earlier occurrence of
the context's last ``n`` tokens (``n`` from ``max_ngram`` down to ``min_ngram``, longest first: a longer match
predicts better) and proposes the tokens that followed it; a match too close to the end to be followed by a
whole proposal gives way to the latest one that is (else to the earliest, followed by the most tokens).
No model runs: the cost is one vectorised scan of the recent context per proposal, and a wrong proposal
costs only its verification rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class NgramProposer:
    """Proposes up to ``num_speculative_tokens`` drafts from the request's own tokens (prompt and output).

    ``lookback`` bounds the scanned context (the newest tokens), so a proposal costs O(lookback * n) however
    long the request grows. Raises ``ValueError`` for a setting out of range.
    """

    num_speculative_tokens: int = 4
    max_ngram: int = 4
    min_ngram: int = 2
    lookback: int = 4096

    def __post_init__(self) -> None:
        for name in ("num_speculative_tokens", "max_ngram", "min_ngram", "lookback"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"NgramProposer.{name} must be an int >= 1, got {value!r}")
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"NgramProposer.min_ngram {self.min_ngram} exceeds max_ngram {self.max_ngram}")

    def propose(self, tokens: Sequence[int]) -> list[int]:
        """The tokens that followed the latest earlier occurrence of the longest matching suffix ([] if
        none)."""
        context = np.asarray(tokens[-self.lookback :], dtype=np.int64)
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            start = _best_match(context, n, self.num_speculative_tokens)
            if start is not None:
                follow = context[start + n : start + n + self.num_speculative_tokens]
                return follow.tolist()
        return []


def _best_match(context: np.ndarray, n: int, k: int) -> int | None:
    """Start ``i`` of a window ``context[i:i+n]`` equal to the last ``n`` tokens and followed by at least one
    token: the latest followed by ``k`` tokens, else the earliest; None if there is none."""
    suffix = context[-n:]
    windows = np.lib.stride_tricks.sliding_window_view(context[:-1], n)  # [L - n, n], ends before the suffix
    hits = np.flatnonzero((windows == suffix).all(axis=1))
    if not hits.size:
        return None
    whole = hits[hits + n + k <= len(context)]
    return int(whole[-1]) if whole.size else int(hits[0])
