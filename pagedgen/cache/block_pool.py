"""The physical block pool: a fixed set of KV-cache blocks, each free, transaction-reserved, owned or cached.

The pool is the single authority on which state every block is in, never on who owns it: it enforces the
legal transitions, each all-or-nothing, and advances a generation on every mutation so a reservation can
prove nothing moved between reserve and commit. The transitions and why CACHED and reference counts exist:
docs/cache.md, "The block pool's states".
"""

from __future__ import annotations

import enum
import operator
from collections import OrderedDict, deque
from collections.abc import Collection, Iterable, Sequence

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
    CACHED = "cached"  # unreferenced, holding published prefix content, evictable (LRU)


class BlockPool:
    """``num_blocks`` physical blocks with ids ``0 .. num_blocks - 1``.

    Free blocks are handed out first-in first-out (a fresh pool gives ``0, 1, 2, ...``; returned blocks go to
    the back), which keeps block ids deterministic for tests. CACHED blocks wait in least-recently-released
    order, each with the stamp of its release (so an exact rollback can put one back where it was). Raises
    ``CacheError`` on any illegal transition, an unknown id, or a repeated id within one call.
    """

    __slots__ = ("num_blocks", "_free", "_states", "_refs", "_lru", "_stamp", "_num_reserved", "_generation")

    def __init__(self, num_blocks: int):
        num_blocks = operator.index(num_blocks)
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._states: list[BlockState] = [BlockState.FREE] * num_blocks
        self._refs: list[int] = [0] * num_blocks  # tables holding each OWNED block (0 otherwise)
        self._lru: OrderedDict[int, int] = OrderedDict()  # CACHED block -> release stamp, oldest first
        self._stamp = 0
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
        return self.num_blocks - len(self._free) - self._num_reserved - len(self._lru)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks that hold published prefix content (evictable, so also allocatable)."""
        return len(self._lru)

    def cached_list(self) -> tuple[int, ...]:
        """The CACHED blocks, least recently released first: the eviction order (for validators and tests)."""
        return tuple(self._lru)

    def cached_stamps(self) -> tuple[tuple[int, int], ...]:
        """``(block, release stamp)`` of every CACHED block in eviction order."""
        return tuple(self._lru.items())

    def refcount(self, block: int) -> int:
        self._check_id(block)
        return self._refs[block]

    def refcounts(self) -> tuple[int, ...]:
        """The reference count of every block, indexed by id (O(pool); for validators and tests)."""
        return tuple(self._refs)

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
        """Move reserved blocks to OWNED with one reference: a commit handed them to block tables."""
        self._check_all(blocks, BlockState.RESERVED, "publish")
        for block in blocks:
            self._states[block] = BlockState.OWNED
            self._refs[block] = 1
        self._num_reserved -= len(blocks)
        self._generation += 1

    def add_ref(self, blocks: Sequence[int]) -> None:
        """One more table holds each block: an OWNED block's count grows, a CACHED one leaves the LRU list
        and becomes OWNED with one reference (a prefix-cache hit committed). A block listed ``n`` times gains
        ``n`` references (several admissions of one step sharing it)."""
        self._check_all(tuple(dict.fromkeys(blocks)), (BlockState.OWNED, BlockState.CACHED), "add_ref")
        for block in blocks:
            if self._states[block] is BlockState.CACHED:
                del self._lru[block]
                self._states[block] = BlockState.OWNED
            self._refs[block] += 1
        self._generation += 1

    def release(self, blocks: Sequence[int], keep: Collection[int] = ()) -> None:
        """One table lets go of each block. A block whose last reference goes is CACHED if it is in ``keep``
        (its content is published in the prefix cache), else FREE. FREE blocks join the back of the free
        list in the given order; CACHED ones join the LRU list in *reverse* order, so that a table's deepest
        blocks are evicted before the prefix they extend."""
        self._check_all(blocks, BlockState.OWNED, "release")
        freed = []
        for block in blocks:
            self._refs[block] -= 1
            if self._refs[block] == 0 and block not in keep:
                self._states[block] = BlockState.FREE
                freed.append(block)
        for block in reversed(blocks):
            if self._refs[block] == 0 and block in keep:
                self._states[block] = BlockState.CACHED
                self._stamp += 1
                self._lru[block] = self._stamp
        self._free.extend(freed)
        self._generation += 1

    def evict(self, count: int, pinned: Collection[int] = ()) -> tuple[tuple[int, int], ...]:
        """Move the ``count`` least recently released CACHED blocks that are not ``pinned`` to FREE (back
        of the free list); returns ``(block, stamp)`` of each, oldest first. All or nothing."""
        count = operator.index(count)
        victims = []
        for block, stamp in self._lru.items():
            if len(victims) == count:
                break
            if block not in pinned:
                victims.append((block, stamp))
        if len(victims) < count:
            raise CacheError(f"cannot evict {count} cached blocks: only {len(victims)} are evictable")
        for block, _stamp in victims:
            del self._lru[block]
            self._states[block] = BlockState.FREE
            self._free.append(block)
        self._generation += 1
        return tuple(victims)

    def restore_cached(self, victims: Iterable[tuple[int, int]]) -> None:
        """Undo :meth:`evict` exactly: FREE blocks go back to CACHED with their old stamps, at their old
        places in the LRU list (a rollback whose model never ran, so the content is intact)."""
        victims = tuple(victims)
        blocks = [block for block, _ in victims]
        self._check_all(blocks, BlockState.FREE, "restore_cached")
        if any(stamp > self._stamp for _, stamp in victims):
            raise CacheError("restore_cached: a stamp from the future")
        gone = set(blocks)
        self._free = deque(block for block in self._free if block not in gone)
        for block, stamp in victims:
            self._states[block] = BlockState.CACHED
            self._lru[block] = stamp
        self._lru = OrderedDict(sorted(self._lru.items(), key=lambda item: item[1]))
        self._generation += 1

    def return_reserved(self, blocks: Sequence[int]) -> None:
        """Move reserved blocks back to the free list: a reservation was discarded."""
        self._check_all(blocks, BlockState.RESERVED, "return_reserved")
        self._release(blocks)
        self._num_reserved -= len(blocks)

    def return_owned(self, blocks: Sequence[int]) -> None:
        """Move owned blocks back to the free list: their request left the cache (each must hold its last
        reference; :meth:`release` is the general form)."""
        self._check_all(blocks, BlockState.OWNED, "return_owned")
        shared = [block for block in blocks if self._refs[block] != 1]
        if shared:
            raise CacheError(f"return_owned: blocks {shared} are shared; release them instead")
        for block in blocks:
            self._refs[block] = 0
        self._release(blocks)

    def check_state(
        self, blocks: Sequence[int], expected: BlockState | tuple[BlockState, ...], action: str
    ) -> None:
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

    def _check_all(
        self, blocks: Sequence[int], expected: BlockState | tuple[BlockState, ...], action: str
    ) -> None:
        """Refuse the whole call before any change if one block is unknown, repeated or in the wrong state."""
        allowed = expected if isinstance(expected, tuple) else (expected,)
        for block in blocks:
            self._check_id(block)
            if self._states[block] not in allowed:
                names = " or ".join(state.value for state in allowed)
                raise CacheError(f"{action}: block {block} is {self._states[block].value}, expected {names}")
        if len(blocks) > 1 and len(set(blocks)) != len(blocks):
            raise CacheError(f"{action}: repeated block ids in {list(blocks)}")
