"""The tiny random-weight checkpoints the family tests run, one builder for every family.

transformers writes each checkpoint (``save_pretrained``) and pagedgen loads it from that directory; the
transformers model stays as the oracle. :class:`FamilyCase` is a plain family (LFM2, Bamba, Gemma);
:class:`tests.model.windowed_cases.Case` adds the full-attention twin of a sliding-window config.
"""

from __future__ import annotations

from typing import Any

import torch

import pagedgen as pg
from tests.model.hf_cases import greedy_by_forwards
from tests.model.tiny_checkpoints import tiny_hf_model

INIT = 0.3  # engine tests: weights large enough that greedy continuations do not collapse into a repeat
LOGITS_INIT = 0.1  # logits tests: the other tiny checkpoints' scale, where 1e-4 is fp32 noise


class FamilyCase:
    def __init__(self, kind: str, tmp_path_factory: Any, init: float = INIT, **overrides: Any):
        self.kind = kind
        self.overrides = {"initializer_range": init, **overrides}
        self.hf = tiny_hf_model(kind, **self.overrides)
        self.path = tmp_path_factory.mktemp(kind)
        self.hf.save_pretrained(self.path)
        self.model = pg.Model(str(self.path), device="cpu")

    def variant(self, **overrides: Any) -> Any:
        """The same weights (same seed) under a changed config: shows what a trait changes."""
        return tiny_hf_model(self.kind, **{**self.overrides, **overrides})

    def reference(self, ids, hf=None) -> torch.Tensor:
        with torch.no_grad():
            return (hf or self.hf)(torch.tensor([ids])).logits[0].float()

    def greedy(self, ids, n) -> list[int]:
        """Greedy continuation by whole-sequence forwards (no cache: the oracle of every step)."""
        return greedy_by_forwards(self.hf, ids, n)
