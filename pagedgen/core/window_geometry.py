"""Sliding-window ring arithmetic: how many blocks a windowed layer keeps per request, where a position goes.

A sliding-window layer attends, from query position ``q``, to the keys ``q - W + 1 .. q`` (``W`` keys, the
query's own included; transformers' ``kv_idx > q_idx - sliding_window``). Its K/V therefore need not grow
with the sequence: each request owns a fixed *ring* of ``R`` physical blocks and position ``p`` lives at ring
slot ``p mod (R * B)``, i.e. in ring block ``(p // B) mod R`` at offset ``p mod B``.

Why ``R = ceil((C + W - 1) / B)``: one step writes at most ``C`` new positions (the per-request chunk cap)
while its earliest query still reads the ``W - 1`` positions before it, so ``C + W - 1`` consecutive
positions are live at once and must map to distinct slots. Positions older than that are overwritten in
place. This is the one definition of that arithmetic; the cache, the step packer and the tests use it.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence


def _positive(name: str, value: int) -> int:
    value = operator.index(value)
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def ring_blocks(chunk_size: int, window: int, block_size: int) -> int:
    """``R = ceil((C + W - 1) / B)``: ring blocks one request needs. Raises ``ValueError`` if any is < 1."""
    c = _positive("chunk_size", chunk_size)
    w = _positive("window", window)
    b = _positive("block_size", block_size)
    return -(-(c + w - 1) // b)


def window_start(position: int, window: int) -> int:
    """First key position the query at ``position`` attends to: ``max(0, position - W + 1)``."""
    return max(0, operator.index(position) - _positive("window", window) + 1)


def ring_slot(ring: Sequence[int], position: int, block_size: int) -> int:
    """Flat cache slot of ``position`` in a request's ``ring`` of physical blocks (``p mod (R * B)``).

    Raises ``ValueError`` for a negative position, an empty ring or a non-positive block size.
    """
    position = operator.index(position)
    block_size = _positive("block_size", block_size)
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    if not ring:
        raise ValueError("a window ring needs at least one block")
    logical_block, offset = divmod(position, block_size)
    return ring[logical_block % len(ring)] * block_size + offset


def ring_columns(ring: Sequence[int], first_block: int, width: int) -> list[int]:
    """The ring read as a block table starting at logical block ``first_block``: column ``k`` holds logical
    block ``first_block + k``, i.e. ring block ``(first_block + k) mod R`` (the ring, repeated)."""
    if not ring:
        raise ValueError("a window ring needs at least one block")
    r = len(ring)
    return [ring[(first_block + k) % r] for k in range(width)]
