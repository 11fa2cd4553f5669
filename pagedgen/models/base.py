"""What the engine needs from a model: a KV geometry and a forward over packed step inputs.

Every model family (and the synthetic test model) implements :class:`CausalLM`. The engine allocates one
:class:`PagedKVCache` from the model's :class:`KVSpec` (both in ``pagedgen.core.kv``) and hands it to every
forward call.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from pagedgen.core.kv import KVSpec, PagedKVCache
from pagedgen.core.step_inputs import StepInputs


@runtime_checkable
class CausalLM(Protocol):
    """A decoder that runs one packed step.

    ``forward`` writes the step's new K/V into ``kv_cache`` through ``inputs.slot_mapping``, reads each
    request's history through ``inputs.block_tables`` and returns float32 logits ``[len(inputs.logits_rows),
    vocab_size]`` for the requested rows only.
    """

    kv_spec: KVSpec
    vocab_size: int

    def forward(self, inputs: StepInputs, kv_cache: PagedKVCache) -> torch.Tensor: ...
