"""The sliding-window checkpoints the windowed model tests run: tiny random-weight Mistral and Qwen2 models
with their windowed layers, and the same weights with the window turned off (the full-attention oracle)."""

from __future__ import annotations

import torch

import pagedgen as pg
from tests.model.family_cases import INIT
from tests.model.hf_cases import greedy_by_forwards
from tests.model.tiny_checkpoints import tiny_hf_model

CASES = {  # name: (family, config overrides, windowed layers, what turns the window off)
    "mistral": ("mistral", {"sliding_window": 8}, (0, 1), {"sliding_window": None}),
    "qwen2-max-window-layers": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1, "num_hidden_layers": 3},
        (1, 2),
        {"use_sliding_window": False},
    ),
    "qwen2-layer-types": (
        "qwen2",
        {
            "use_sliding_window": True,
            "sliding_window": 6,
            "num_hidden_layers": 3,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        },
        (0, 2),
        {"use_sliding_window": False, "layer_types": None},
    ),
}


class Case:
    def __init__(self, name, tmp_path_factory, init=INIT):
        family, overrides, self.windowed, off = CASES[name]
        self.hf = tiny_hf_model(family, initializer_range=init, **overrides)
        self.hf_full = tiny_hf_model(family, initializer_range=init, **{**overrides, **off})  # same weights
        path = tmp_path_factory.mktemp(name)
        self.hf.save_pretrained(path)
        self.model = pg.Model(str(path), device="cpu")
        self.window = overrides["sliding_window"]

    def reference(self, ids, full=False):
        with torch.no_grad():
            return (self.hf_full if full else self.hf)(torch.tensor([ids])).logits[0].float()

    def greedy(self, ids, n):
        """Greedy continuation by whole-sequence forwards (no cache). Not ``generate()``: on the Qwen2 mix of
        full and sliding layers transformers 5.24's ``generate`` returns first-step logits that differ from
        its own forward over the same prompt, while every forward agrees with ours."""
        return greedy_by_forwards(self.hf, ids, n)
