"""What a model's fixed (request-indexed) decoder state looks like: one :class:`FixedStateSpec` per tensor.

A ``fixed_conv`` or ``fixed_recurrent`` layer keeps one value per
request (a short convolution's last inputs, a recurrent state) that every step *replaces* rather than
appends to. The model declares each such tensor's per-request row geometry and dtype
(``model.fixed_state_specs``); the engine checks them against the manifest's fixed groups and keeps them in a
:class:`pagedgen.cache.fixed_state_pool.FixedStatePool`. A step hands the model its rows through
:class:`pagedgen.core.step_inputs.FixedStateInputs` (docs/cache.md, "Fixed state").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagedgen.core.state_manifest import StateKind


@dataclass(frozen=True, slots=True)
class FixedStateSpec:
    """One fixed-state tensor of one layer: ``row_shape`` per request (the batch axis is the pool's).

    ``name`` is the binding name the model reads and writes (unique per model). Raises ``ValueError`` for a
    paged kind, a negative layer, or a row shape with a non-positive axis.
    """

    name: str
    kind: StateKind
    layer: int
    row_shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.kind is StateKind.PAGED_KV:
            raise ValueError(f"FixedStateSpec {self.name!r}: kind must be fixed_conv or fixed_recurrent")
        if isinstance(self.layer, bool) or not isinstance(self.layer, int) or self.layer < 0:
            raise ValueError(f"FixedStateSpec {self.name!r}: layer must be an int >= 0, got {self.layer!r}")
        if not self.row_shape or any(
            isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in self.row_shape
        ):
            raise ValueError(
                f"FixedStateSpec {self.name!r}: row_shape must be positive ints, got {self.row_shape!r}"
            )

    @property
    def row_bytes(self) -> int:
        """Bytes of one request's row."""
        return math.prod(self.row_shape) * torch.empty((), dtype=self.dtype).element_size()
