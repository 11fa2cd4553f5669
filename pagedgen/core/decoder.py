"""What the engine, the executor and guidance need of a model: the role that ``pg.Model`` and
``SyntheticModel`` both fill, so no collaborator of a model is left untyped.

It lives in ``core`` (which imports no other part of pagedgen) because every layer above it takes a model: the
cache planner reads its KV geometry and state manifest, the runner calls its runtime once per step, guidance
reads its tokenizer. Structural typing (``typing.Protocol``): a model satisfies it by having the members, not
by inheriting from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from pagedgen.core.fixed_state_spec import FixedStateSpec
from pagedgen.core.kv import KVSpec, PagedKVCache
from pagedgen.core.state_manifest import StateManifest
from pagedgen.core.step_inputs import StepInputs


class TextTokenizer(Protocol):
    """The tokenizer calls the engine and guidance make (stop strings, byte vocabularies, detokenizing)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class DecoderRuntime(Protocol):
    """The executable model: one call per step over packed inputs, writing and reading the paged cache."""

    def forward(self, inputs: StepInputs, kv_cache: PagedKVCache | None) -> torch.Tensor:
        """Float logits ``[len(inputs.logits_rows), vocab]``."""
        ...


class DecoderModel(Protocol):
    """A loaded decoder as the engine sees it (``pg.Model`` and ``pg.SyntheticModel``)."""

    @property
    def device(self) -> torch.device: ...

    @property
    def runtime(self) -> DecoderRuntime: ...

    @property
    def kv_spec(self) -> KVSpec: ...

    @property
    def fixed_state_specs(self) -> tuple[FixedStateSpec, ...]: ...

    @property
    def state_manifest(self) -> StateManifest | None: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_context(self) -> int: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def tokenizer(self) -> TextTokenizer: ...
