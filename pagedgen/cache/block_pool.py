"""The physical block pool: a fixed set of KV-cache blocks, each free, transaction-reserved or owned.

The pool is the single authority on which state every block is in. It never decides *who* owns a block
(block tables and the live reservation record that); it only enforces the legal transitions

    FREE --reserve--> RESERVED --publish--> OWNED --return_owned--> FREE
                      RESERVED --return_reserved--> FREE

each all-or-nothing (a refused call changes nothing), and advances ``generation`` on every mutation so a
reservation can prove nothing moved between reserve and commit. Every operation costs O(blocks touched).
"""

from __future__ import annotations

import enum
import operator
from collections import deque
from collections.abc import Sequence

from pagedgen.errors import CacheError


def num_blocks_for_budget(memory_bytes: int, bytes_per_block: int) -> int:
    """How many whole blocks fit in ``memory_bytes`` (``bytes_per_block`` from ``KVSpec.bytes_per_block``).

    Raises ``ValueError`` if the budget is negative, the block cost is not positive, or no block fits.
    """
    memory_bytes = operator.index(memory_bytes)
    bytes_per_block = operator.index(bytes_per_block)
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
    if memory_bytes < 0:
        raise ValueError(f"memory_bytes must be >= 0, got {memory_bytes}")
    num_blocks = memory_bytes // bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"a KV-cache budget of {memory_bytes} bytes holds no block of {bytes_per_block} bytes; "
            "raise kv_cache_memory_bytes or lower block_size"
        )
    return num_blocks


class BlockState(enum.Enum):
    FREE = "free"
    RESERVED = "reserved"
    OWNED = "owned"


class BlockPool:
    """``num_blocks`` physical blocks with ids ``0 .. num_blocks - 1``.

    Free blocks are handed out first-in first-out (a fresh pool gives ``0, 1, 2, ...``; returned blocks go to
    the back), which keeps block ids deterministic for tests. Raises ``CacheError`` on any illegal transition,
    an unknown id, or a repeated id within one call.
    """

    __slots__ = ("num_blocks", "_free", "_states", "_num_reserved", "_generation")

    def __init__(self, num_blocks: int):
        num_blocks = operator.index(num_blocks)
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._states: list[BlockState] = [BlockState.FREE] * num_blocks
        self._num_reserved = 0
        self._generation = 0

    @property
    def generation(self) -> int:
        """Advanced by every mutation of block state or of committed occupancy (:meth:`record_mutation`)."""
        return self._generation

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_reserved(self) -> int:
        return self._num_reserved

    @property
    def num_owned(self) -> int:
        return self.num_blocks - len(self._free) - self._num_reserved

    def free_list(self) -> tuple[int, ...]:
        """The free blocks in the order they will be handed out (O(pool); for validators and tests)."""
        return tuple(self._free)

    def state(self, block: int) -> BlockState:
        self._check_id(block)
        return self._states[block]

    def states(self) -> tuple[BlockState, ...]:
        """The state of every block, indexed by id (O(pool); for validators and tests)."""
        return tuple(self._states)

    def reserve(self, count: int) -> tuple[int, ...]:
        """Move ``count`` free blocks to RESERVED and return their ids; all or nothing."""
        count = operator.index(count)
        if count < 0:
            raise CacheError(f"cannot reserve a negative number of blocks ({count})")
        if count > len(self._free):
            raise CacheError(
                f"cannot reserve {count} blocks: only {len(self._free)} of {self.num_blocks} free"
            )
        blocks = tuple(self._free.popleft() for _ in range(count))
        for block in blocks:
            self._states[block] = BlockState.RESERVED
        self._num_reserved += count
        self._generation += 1
        return blocks

    def publish(self, blocks: Sequence[int]) -> None:
        """Move reserved blocks to OWNED: a commit handed them to block tables."""
        self._check_all(blocks, BlockState.RESERVED, "publish")
        for block in blocks:
            self._states[block] = BlockState.OWNED
        self._num_reserved -= len(blocks)
        self._generation += 1

    def return_reserved(self, blocks: Sequence[int]) -> None:
        """Move reserved blocks back to the free list: a reservation was discarded."""
        self._check_all(blocks, BlockState.RESERVED, "return_reserved")
        self._release(blocks)
        self._num_reserved -= len(blocks)

    def return_owned(self, blocks: Sequence[int]) -> None:
        """Move owned blocks back to the free list: their request left the cache."""
        self._check_all(blocks, BlockState.OWNED, "return_owned")
        self._release(blocks)

    def check_state(self, blocks: Sequence[int], expected: BlockState, action: str) -> None:
        """Raise ``CacheError`` unless every block is a distinct id in state ``expected`` (mutates nothing):
        lets a caller prove a two-pool change legal before it changes either pool."""
        self._check_all(blocks, expected, action)

    def record_mutation(self) -> None:
        """Advance the generation for an ownership change that moves no block (a committed-slot advance)."""
        self._generation += 1

    def _release(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            self._states[block] = BlockState.FREE
        self._free.extend(blocks)
        self._generation += 1

    def _check_id(self, block: int) -> None:
        if not (isinstance(block, int) and 0 <= block < self.num_blocks):
            raise CacheError(f"block id {block!r} is not in the pool's range 0..{self.num_blocks - 1}")

    def _check_all(self, blocks: Sequence[int], expected: BlockState, action: str) -> None:
        """Refuse the whole call before any change if one block is unknown, repeated or in the wrong state."""
        for block in blocks:
            self._check_id(block)
            if self._states[block] is not expected:
                raise CacheError(
                    f"{action}: block {block} is {self._states[block].value}, expected {expected.value}"
                )
        if len(blocks) > 1 and len(set(blocks)) != len(blocks):
            raise CacheError(f"{action}: repeated block ids in {list(blocks)}")
