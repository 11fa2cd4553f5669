"""The window-ring pool's shape: how many blocks it has and how many each resident request owns.

Sliding-window layers keep their K/V in a second block pool,
separate from the full-context pool: every resident request owns exactly ``ring_blocks`` of its blocks
(``R = ceil((C + W - 1) / B)``, :func:`pagedgen.core.window_geometry.ring_blocks`), taken at admission in
the same
reservation as its first full-context blocks and returned with them on removal. The ring never grows, so
its cost per request is fixed whatever the sequence length; a step may write at most ``chunk_size`` (``C``)
positions per request, which the scheduler enforces.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from pagedgen.core.window_geometry import ring_blocks


@dataclass(frozen=True, slots=True)
class WindowRingSpec:
    """A manager's window pool: ``num_blocks`` blocks, rings for ``window``, ``chunk_size``, ``block_size``.

    Raises ``ValueError`` for a non-positive field or a pool that cannot hold one ring.
    """

    window: int
    chunk_size: int
    block_size: int
    num_blocks: int

    def __post_init__(self) -> None:
        for name in ("window", "chunk_size", "block_size", "num_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or operator.index(value) <= 0:
                raise ValueError(f"WindowRingSpec.{name} must be positive, got {value!r}")
        if self.num_blocks < self.ring_blocks:
            raise ValueError(
                f"a window pool of {self.num_blocks} blocks cannot hold one ring of {self.ring_blocks} "
                f"(window {self.window}, chunk {self.chunk_size}, block size {self.block_size})"
            )

    @property
    def ring_blocks(self) -> int:
        """Blocks each resident request owns in this pool."""
        return ring_blocks(self.chunk_size, self.window, self.block_size)

    @classmethod
    def for_residents(
        cls, window: int, chunk_size: int, block_size: int, max_residents: int
    ) -> WindowRingSpec:
        """A pool with one ring per possible resident: window blocks then never limit admission."""
        ring = ring_blocks(chunk_size, window, block_size)
        return cls(window, chunk_size, block_size, ring * max_residents)
