"""Reserve -> commit / discard leave exactly the documented state; misuse is refused without change."""

from __future__ import annotations

import pytest

from pagedgen.cache import CacheCandidate, PagedCacheManager, ReservationState
from pagedgen.cache.block_pool import BlockState
from pagedgen.engine.invariants import validate_cache
from pagedgen.errors import CacheError


def new(rid: int, slots: int) -> CacheCandidate:
    return CacheCandidate(rid, slots, is_new=True)


def res(rid: int, slots: int) -> CacheCandidate:
    return CacheCandidate(rid, slots, is_new=False)


def snapshot(manager: PagedCacheManager) -> tuple:
    return (
        manager.pool.generation,
        manager.pool.free_list(),
        manager.pool.states(),
        {rid: (manager.block_table(rid), manager.committed_slots(rid)) for rid in manager.resident_ids()},
    )


@pytest.fixture
def manager() -> PagedCacheManager:
    """Two residents: 1 owns blocks (0, 1) with 5 slots, 2 owns (2,) with 3 slots; blocks 3..7 free."""
    manager = PagedCacheManager(num_blocks=8, block_size=4, max_batch_size=4)
    manager.reserve([new(1, 5), new(2, 3)]).commit()
    assert validate_cache(manager) == []
    return manager


def test_fixture_state_is_exact(manager: PagedCacheManager) -> None:
    assert manager.resident_ids() == (1, 2)
    assert (manager.block_table(1), manager.committed_slots(1)) == ((0, 1), 5)
    assert (manager.block_table(2), manager.committed_slots(2)) == ((2,), 3)
    assert manager.pool.free_list() == (3, 4, 5, 6, 7)


def test_reserve_leaves_committed_state_and_exposes_combined_tables(manager: PagedCacheManager) -> None:
    reservation = manager.reserve([res(2, 5), res(1, 6), new(3, 9)])
    assert manager.live_reservation is reservation and reservation.state is ReservationState.LIVE
    assert reservation.block_table(2) == (2, 3)
    assert reservation.block_table(1) == (0, 1)
    assert reservation.block_table(3) == (4, 5, 6)
    assert reservation.reserved_blocks() == (3, 4, 5, 6)
    assert [reservation.committed_slots(r) for r in (2, 1, 3)] == [3, 5, 0]
    # Committed ownership is untouched until commit.
    assert manager.block_table(2) == (2,) and manager.committed_slots(2) == 3
    assert not manager.is_resident(3)
    assert manager.pool.free_list() == (7,)
    stats = manager.stats()
    assert (stats.total_blocks, stats.free_blocks, stats.reserved_blocks, stats.owned_blocks) == (8, 1, 4, 3)
    assert stats.blocks_per_request == {1: 2, 2: 1}
    assert validate_cache(manager) == []


def test_reserve_then_commit_publishes_exact_blocks(manager: PagedCacheManager) -> None:
    reservation = manager.reserve([res(2, 5), res(1, 6), new(3, 9)])
    reservation.commit()
    assert reservation.state is ReservationState.COMMITTED and manager.live_reservation is None
    assert manager.resident_ids() == (1, 2, 3)
    assert (manager.block_table(1), manager.committed_slots(1)) == ((0, 1), 6)
    assert (manager.block_table(2), manager.committed_slots(2)) == ((2, 3), 5)
    assert (manager.block_table(3), manager.committed_slots(3)) == ((4, 5, 6), 9)
    assert manager.pool.free_list() == (7,)
    assert [manager.pool.state(b) for b in range(8)] == [BlockState.OWNED] * 7 + [BlockState.FREE]
    stats = manager.stats()
    assert (stats.free_blocks, stats.reserved_blocks, stats.owned_blocks, stats.resident_requests) == (
        1,
        0,
        7,
        3,
    )
    assert stats.blocks_per_request == {1: 2, 2: 2, 3: 3}
    assert validate_cache(manager) == []


def test_reserve_then_discard_restores_exact_state(manager: PagedCacheManager) -> None:
    before = snapshot(manager)
    reservation = manager.reserve([res(2, 5), new(3, 9)])
    assert reservation.reserved_blocks() == (3, 4, 5, 6)
    reservation.discard()
    assert reservation.state is ReservationState.DISCARDED and manager.live_reservation is None
    generation, free, states, tables = snapshot(manager)
    assert (states, tables) == before[2:]
    assert free == (7, 3, 4, 5, 6)  # the same free set; returned blocks go to the back
    assert generation > before[0]
    assert not manager.is_resident(3)
    reservation.discard()  # idempotent
    assert snapshot(manager) == (generation, free, states, tables)
    assert validate_cache(manager) == []


def test_commit_narrowed_keeps_every_reserved_block(manager: PagedCacheManager) -> None:
    reservation = manager.reserve([res(1, 9), new(3, 10)])  # 1 grows to 3 blocks, 3 gets 3 blocks
    reservation.commit({1: 6, 3: 4})  # partial prefill chunk / rejected drafts
    assert (manager.block_table(1), manager.committed_slots(1)) == ((0, 1, 3), 6)
    assert (manager.block_table(3), manager.committed_slots(3)) == ((4, 5, 6), 4)
    assert validate_cache(manager) == []
    # The narrowed request continues without new blocks.
    plan = manager.plan_step_resources([res(3, 10), res(1, 9)])
    assert plan.new_blocks == 0 and len(plan.selected) == 2


def test_commit_to_the_committed_boundary_is_allowed(manager: PagedCacheManager) -> None:
    manager.reserve([res(1, 6), new(3, 2)]).commit({1: 5, 3: 0})
    assert manager.committed_slots(1) == 5 and manager.committed_slots(3) == 0
    assert manager.block_table(3) == (3,)
    assert validate_cache(manager) == []


@pytest.mark.parametrize(
    ("advance", "match"),
    [
        ({1: 4}, r"outside \[5, 6\]"),
        ({1: 7}, r"outside \[5, 6\]"),
        ({2: 4}, "not part"),
        ({1: 5.0}, "must be an int"),
    ],
)
def test_bad_advance_is_refused_without_change(manager: PagedCacheManager, advance: dict, match: str) -> None:
    reservation = manager.reserve([res(1, 6), new(3, 2)])
    before = snapshot(manager)
    for attempt in (reservation.validate_commit, reservation.commit):
        with pytest.raises(CacheError, match=match):
            attempt(advance)
        assert snapshot(manager) == before
    assert reservation.state is ReservationState.LIVE
    reservation.commit()
    assert manager.committed_slots(1) == 6


def test_validate_commit_is_repeatable_and_mutates_nothing(manager: PagedCacheManager) -> None:
    reservation = manager.reserve([res(1, 6), new(3, 2)])
    before = snapshot(manager)
    for _ in range(3):
        reservation.validate_commit()
        reservation.validate_commit({1: 5})
    assert snapshot(manager) == before and reservation.state is ReservationState.LIVE


def test_validate_commit_rejects_an_intervening_pool_mutation(manager: PagedCacheManager) -> None:
    reservation = manager.reserve([res(1, 6)])
    stray = manager.pool.reserve(1)  # someone else took a block behind the reservation's back
    with pytest.raises(CacheError, match="block pool changed"):
        reservation.validate_commit()
    with pytest.raises(CacheError, match="block pool changed"):
        reservation.commit()
    assert manager.block_table(1) == (0, 1) and manager.committed_slots(1) == 5
    assert reservation.state is ReservationState.LIVE
    manager.pool.return_reserved(stray)
    with pytest.raises(CacheError):  # returning the block is still a change since reserve
        reservation.validate_commit()
    reservation.discard()
    assert validate_cache(manager) == []


def test_validate_commit_rejects_a_table_change_without_a_pool_change(manager: PagedCacheManager) -> None:
    reservation = manager.reserve([res(1, 6)])
    manager.tables()[2].committed_slots = 4  # a raw edit of an omitted resident's table
    with pytest.raises(CacheError, match="request 2 changed"):
        reservation.validate_commit()
    manager.tables()[2].committed_slots = 3
    reservation.validate_commit()  # the snapshot matches again


def test_validate_commit_rejects_a_block_that_is_no_longer_reserved(manager: PagedCacheManager) -> None:
    reservation = manager.reserve([res(1, 9)])  # reserves block 3
    manager.pool.publish([3])
    manager.pool._generation = reservation._generation  # forge the generation to reach the per-block check
    with pytest.raises(CacheError, match="block 3 .* no longer reserved"):
        reservation.validate_commit()


def test_second_live_reservation_is_rejected(manager: PagedCacheManager) -> None:
    first = manager.reserve([res(1, 6)])
    before = snapshot(manager)
    with pytest.raises(CacheError, match="reservation is live"):
        manager.reserve([new(3, 1)])
    assert snapshot(manager) == before and manager.live_reservation is first
    first.commit()
    second = manager.reserve([new(3, 1)])
    assert manager.live_reservation is second


def test_commit_and_discard_after_close(manager: PagedCacheManager) -> None:
    reservation = manager.reserve([res(1, 6)])
    reservation.commit()
    with pytest.raises(CacheError, match="committed reservation"):
        reservation.validate_commit()
    with pytest.raises(CacheError, match="committed reservation"):
        reservation.commit()
    with pytest.raises(CacheError, match="discard a committed"):
        reservation.discard()
    discarded = manager.reserve([res(1, 7)])
    discarded.discard()
    with pytest.raises(CacheError, match="discarded reservation"):
        discarded.commit()
    assert manager.committed_slots(1) == 6


def test_reservation_rejects_unknown_request(manager: PagedCacheManager) -> None:
    reservation = manager.reserve([res(1, 6)])
    with pytest.raises(CacheError, match="not part"):
        reservation.block_table(2)


@pytest.mark.parametrize(
    ("selected", "match"),
    [
        ([], "empty"),
        ([new(3, 21)], "only 5 of 8 free"),  # 6 blocks: fits the pool, not the free list
        ([new(3, 33)], "can never fit"),
        ([new(3, 1), new(4, 1), new(5, 1)], "exceed max_batch_size"),
        ([new(1, 1)], "already resident"),
        ([res(1, 4)], "below its 5"),
    ],
)
def test_reserve_is_all_or_nothing(manager: PagedCacheManager, selected: list, match: str) -> None:
    before = snapshot(manager)
    with pytest.raises(CacheError, match=match):
        manager.reserve(selected)
    assert snapshot(manager) == before and manager.live_reservation is None


def test_reserve_rejects_more_rows_than_max_batch_size() -> None:
    manager = PagedCacheManager(num_blocks=8, block_size=4, max_batch_size=2)
    manager.reserve([new(1, 1), new(2, 1)]).commit()
    with pytest.raises(CacheError, match="3 rows exceed"):
        manager.reserve([res(1, 2), res(2, 2), new(3, 1)])


def test_reserve_respects_table_width() -> None:
    manager = PagedCacheManager(num_blocks=8, block_size=4, max_batch_size=2, max_blocks_per_table=2)
    with pytest.raises(CacheError, match="can never fit"):
        manager.reserve([new(1, 9)])


def test_deallocate_returns_every_block(manager: PagedCacheManager) -> None:
    assert manager.deallocate(1) is True
    assert manager.resident_ids() == (2,)
    assert manager.pool.free_list() == (3, 4, 5, 6, 7, 0, 1)
    assert not manager.is_resident(1)
    assert manager.deallocate(1) is False
    assert validate_cache(manager) == []
    assert manager.deallocate(2) is True
    assert manager.pool.num_free == 8 and manager.stats().blocks_per_request == {}


def test_deallocate_is_refused_while_a_reservation_is_live(manager: PagedCacheManager) -> None:
    reservation = manager.reserve([res(1, 6)])
    before = snapshot(manager)
    with pytest.raises(CacheError, match="reservation is live"):
        manager.deallocate(2)
    assert snapshot(manager) == before
    reservation.validate_commit()
    reservation.discard()
    assert manager.deallocate(2) is True


def test_a_released_request_can_be_admitted_again(manager: PagedCacheManager) -> None:
    manager.deallocate(1)
    reservation = manager.reserve([new(1, 2)])
    assert reservation.block_table(1) == (3,)
    reservation.commit()
    assert manager.resident_ids() == (2, 1)  # admission order
    assert manager.committed_slots(1) == 2


def test_unknown_request_queries_raise(manager: PagedCacheManager) -> None:
    with pytest.raises(CacheError, match="not resident"):
        manager.committed_slots(9)
    with pytest.raises(CacheError, match="not resident"):
        manager.block_table(9)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_blocks": 0}, "num_blocks"),
        ({"block_size": -1}, "block_size"),
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"max_blocks_per_table": 0}, "max_blocks_per_table"),
        ({"num_blocks": 2.5}, "num_blocks"),
    ],
)
def test_manager_settings_are_validated(kwargs: dict, field: str) -> None:
    settings = {"num_blocks": 4, "block_size": 4, "max_batch_size": 2, **kwargs}
    with pytest.raises(ValueError, match=field):
        PagedCacheManager(**settings)


def test_string_request_ids_are_opaque() -> None:
    manager = PagedCacheManager(num_blocks=2, block_size=1, max_batch_size=2)
    manager.reserve([CacheCandidate("a", 1, True), CacheCandidate(("b", 2), 1, True)]).commit()
    assert manager.resident_ids() == ("a", ("b", 2))
    assert manager.block_table(("b", 2)) == (1,)
