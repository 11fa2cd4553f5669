"""A request's committed block table, and the pure arithmetic that maps tokens onto paged slots.

A request never owns one contiguous cache region: its logical token positions are cut into blocks of
``block_size`` slots and each logical block points at any physical block of the pool. Position ``p`` lives in
logical block ``p // block_size`` at offset ``p % block_size``; the flat slot the model writes K/V into is
``table[p // block_size] * block_size + p % block_size``. These helpers are the single definition of that
arithmetic; the planner, the reservation and the invariant validator all use them.
"""

from __future__ import annotations

import operator
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Number of blocks needed to hold ``num_tokens`` slots: ``ceil(num_tokens / block_size)``.

    Zero tokens need zero blocks. Raises ``ValueError`` for a negative count or a non-positive block size.
    """
    num_tokens = operator.index(num_tokens)
    block_size = operator.index(block_size)
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return -(-num_tokens // block_size)


def slot_of_position(block_table: Sequence[int], position: int, block_size: int) -> int:
    """Flat cache slot (``block * block_size + offset``) of logical token ``position``.

    Raises ``ValueError`` if the position is negative or lies beyond the table's last block, or if the block
    size is not positive.
    """
    position = operator.index(position)
    block_size = operator.index(block_size)
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    logical_block, offset = divmod(position, block_size)
    if logical_block >= len(block_table):
        raise ValueError(
            f"position {position} needs logical block {logical_block} but the table holds "
            f"{len(block_table)} blocks of {block_size} slots"
        )
    return block_table[logical_block] * block_size + offset


@dataclass(slots=True)
class BlockTable:
    """Committed cache ownership of one resident request.

    ``blocks`` are the physical blocks in logical order; ``committed_slots`` counts the leading slots that
    hold committed K/V (it may be smaller than the table's capacity: an admitted prefill owns blocks for its
    whole prompt before all of it has run). ``window_blocks`` is the request's ring in the window pool
    (:mod:`pagedgen.cache.window_pool`; empty without one): fixed at admission, it never grows.
    ``generation`` advances on every change so a reservation can prove the table is exactly as it found it.
    Only the cache manager and its reservation mutate a table.
    """

    request_id: Hashable
    blocks: list[int] = field(default_factory=list)
    committed_slots: int = 0
    generation: int = 0
    window_blocks: list[int] = field(default_factory=list)

    def capacity(self, block_size: int) -> int:
        """Slots the table's blocks can hold."""
        return len(self.blocks) * block_size

    def advance(self, new_blocks: Sequence[int], committed_slots: int) -> None:
        """Append ``new_blocks`` and set the committed slot count (the caller validated both)."""
        self.blocks.extend(new_blocks)
        self.committed_slots = committed_slots
        self.generation += 1
