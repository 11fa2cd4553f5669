"""The cache invariant validator finds every kind of corruption it claims to, and nothing in sound state."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pagedgen.cache import CacheCandidate, PagedCacheManager
from pagedgen.cache.block_pool import BlockState
from pagedgen.cache.block_table import BlockTable
from pagedgen.engine.invariants import validate_cache, validate_residents


def build() -> PagedCacheManager:
    """Residents 1 -> blocks (0, 1) with 5 slots and 2 -> (2,) with 3 slots; a live reservation holds 3, 4."""
    manager = PagedCacheManager(num_blocks=8, block_size=4, max_batch_size=3, max_blocks_per_table=4)
    manager.reserve([CacheCandidate(1, 5, True), CacheCandidate(2, 3, True)]).commit()
    manager.reserve([CacheCandidate(2, 5, False), CacheCandidate(3, 4, True)])
    return manager


def test_sound_state_has_no_violations() -> None:
    manager = build()
    assert validate_cache(manager) == []
    manager.live_reservation.commit()
    assert validate_cache(manager) == []
    manager.deallocate(1)
    assert validate_cache(manager) == []


def _states(manager: PagedCacheManager) -> list[BlockState]:
    return manager.pool._states


def _table(manager: PagedCacheManager, rid: int) -> BlockTable:
    return manager.tables()[rid]


def _widen_table_1(manager: PagedCacheManager) -> None:
    """Give request 1 three more (properly owned) blocks: 5 in all, over the width of 4."""
    for block in (5, 6, 7):
        manager.pool._free.remove(block)
        _states(manager)[block] = BlockState.OWNED
        _table(manager, 1).blocks.append(block)


def _stray_reserved_block(manager: PagedCacheManager) -> None:
    """A block left RESERVED after the reservation closed."""
    manager.live_reservation.discard()
    _states(manager)[manager.pool._free.pop()] = BlockState.RESERVED
    manager.pool._num_reserved = 1


CORRUPTIONS: dict[str, tuple[Callable[[PagedCacheManager], None], str]] = {
    "block owned twice": (lambda m: _table(m, 2).blocks.append(0), "owned by both 1 and 2"),
    "block repeated in one table": (lambda m: _table(m, 1).blocks.append(1), "owned by both 1 and 1"),
    "invalid id in a table": (lambda m: _table(m, 1).blocks.append(99), "invalid block id 99"),
    "slots beyond capacity": (
        lambda m: setattr(_table(m, 2), "committed_slots", 5),
        "outside its capacity 4",
    ),
    "negative slots": (lambda m: setattr(_table(m, 2), "committed_slots", -1), "outside its capacity"),
    "table under the wrong id": (lambda m: setattr(_table(m, 2), "request_id", 7), "names request 7"),
    "table wider than supported": (_widen_table_1, "5 blocks exceed the table width 4"),
    "owned block also free": (lambda m: m.pool._free.append(0), "block 0 is in the free list but owned"),
    "free block lost": (lambda m: m.pool._free.pop(), "free + 2 reserved + 3 owned != 8"),
    "free list duplicate": (
        lambda m: m.pool._free.append(m.pool._free[0]),
        "appears 2 times in the free list",
    ),
    "free list invalid id": (lambda m: m.pool._free.append(-3), "free list holds invalid block id -3"),
    "owned state without a table": (
        lambda m: _states(m).__setitem__(m.pool._free.pop(), BlockState.OWNED),
        "4 blocks are OWNED but tables hold 3",
    ),
    "reserved block published early": (
        lambda m: _states(m).__setitem__(3, BlockState.OWNED),
        "block 3 is held by the reservation but owned",
    ),
    "reserved counter drift": (lambda m: setattr(m.pool, "_num_reserved", 1), "pool counts 1 reserved"),
    "reserved block without reservation": (_stray_reserved_block, "1 blocks are RESERVED but no reservation"),
    "too many residents": (
        lambda m: m._tables.update({8: BlockTable(8), 9: BlockTable(9)}),
        "4 residents exceed max_batch_size 3",
    ),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_corruption_is_reported(name: str) -> None:
    corrupt, expected = CORRUPTIONS[name]
    manager = build()
    corrupt(manager)
    violations = validate_cache(manager)
    assert any(expected in v for v in violations), violations


def test_reservation_row_disagreeing_with_residency_is_reported() -> None:
    manager = build()
    manager._tables[3] = BlockTable(3)  # request 3 became resident behind the reservation's back
    violations = validate_cache(manager)
    assert any("admits 3, which is already resident" in v for v in violations), violations


def test_validate_residents() -> None:
    manager = build()
    manager.live_reservation.commit()
    assert validate_residents(manager, {1: 5, 2: 5, 3: 4}) == []
    violations = validate_residents(manager, {1: 4, 2: 5, 9: 1})
    assert violations == [
        "request 3 is resident in the cache but not expected",
        "request 1 has 5 committed slots, expected 4",
        "request 9 is expected resident but owns no block table",
    ]
