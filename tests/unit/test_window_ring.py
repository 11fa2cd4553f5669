"""Sliding-window rings: the arithmetic at its boundaries, ring packing, and the window pool's accounting.

The ring rule (docs/cache.md, "Sliding-window rings"): ``R = ceil((C + W - 1) / B)`` blocks per request,
position ``p`` at ring slot ``p mod (R * B)``, a step capped to ``C`` positions so it never overwrites a
position its earliest query still reads.
"""

from __future__ import annotations

import pytest

from pagedgen.cache import CacheCandidate, DeferReason, PagedCacheManager, WindowRingSpec
from pagedgen.core.window_geometry import ring_blocks, ring_columns, ring_slot, window_start
from pagedgen.engine.invariants import validate_cache
from pagedgen.errors import CacheError
from pagedgen.executor.inputs import SequenceChunk, pack_step

# ---- arithmetic ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("chunk", "window", "block", "expected"),
    [
        (1, 1, 1, 1),
        (1, 1, 16, 1),  # one live position
        (8, 9, 16, 1),  # C + W - 1 == B exactly
        (8, 10, 16, 2),  # one past a block
        (1, 16, 16, 1),  # a decode-only cap: W positions live
        (1, 17, 16, 2),
        (2048, 4096, 16, 384),  # Mistral-7B's window at the default token budget
        (16, 4096, 16, 257),
    ],
)
def test_ring_blocks_at_block_boundaries(chunk, window, block, expected):
    assert ring_blocks(chunk, window, block) == expected


@pytest.mark.parametrize("args", [(0, 4, 4), (4, 0, 4), (4, 4, 0), (-1, 4, 4)])
def test_ring_blocks_refuses_non_positive_sizes(args):
    with pytest.raises(ValueError, match="must be positive"):
        ring_blocks(*args)


def test_window_start_clamps_at_the_sequence_start():
    assert [window_start(p, 3) for p in range(6)] == [0, 0, 0, 1, 2, 3]
    assert [window_start(p, 1) for p in range(3)] == [0, 1, 2]


def test_ring_slot_is_position_modulo_the_ring():
    ring, block = [7, 3, 5], 4
    for p in range(3 * 12 + 5):  # three wraps and a bit
        assert ring_slot(ring, p, block) == ring[(p // block) % 3] * block + p % block
        assert ring_slot(ring, p, block) == ring_slot(ring, p % 12, block)
    with pytest.raises(ValueError, match=">= 0"):
        ring_slot(ring, -1, block)
    with pytest.raises(ValueError, match="at least one block"):
        ring_slot([], 0, block)


@pytest.mark.parametrize(
    ("chunk", "window", "block"), [(1, 1, 1), (3, 2, 4), (5, 8, 4), (8, 9, 16), (7, 3, 2)]
)
def test_live_positions_never_share_a_slot_and_one_block_less_would_collide(chunk, window, block):
    r = ring_blocks(chunk, window, block)
    ring = list(range(100, 100 + r))
    live = chunk + window - 1
    for first in range(3 * r * block):  # every alignment over several wraps
        slots = [ring_slot(ring, p, block) for p in range(first, first + live)]
        assert len(set(slots)) == live
    if r > 1:
        smaller = ring[:-1]
        assert any(
            len({ring_slot(smaller, p, block) for p in range(first, first + live)}) < live
            for first in range(r * block)
        )


def test_ring_columns_repeat_the_ring_from_a_logical_block():
    assert ring_columns([7, 3, 5], 0, 7) == [7, 3, 5, 7, 3, 5, 7]
    assert ring_columns([7, 3, 5], 4, 3) == [3, 5, 7]


# ---- packing -----------------------------------------------------------------------------------------------


def test_pack_step_maps_new_tokens_to_ring_slots_and_rotates_tables():
    block, window = 4, 3
    rings = [[9, 2, 6], [4, 1, 8]]  # R = ceil((5 + 3 - 1) / 4) = 2; a 3-block ring is as valid
    chunks = [
        SequenceChunk(list(range(5)), past_len=0, block_table=[0, 1], window_ring=rings[0]),
        SequenceChunk([1], past_len=29, block_table=list(range(10, 18)), window_ring=rings[1]),
    ]
    inputs = pack_step(chunks, block, window=window)
    ring = inputs.window
    assert ring is not None and ring.size == window
    expected = [ring_slot(rings[0], p, block) for p in range(5)] + [ring_slot(rings[1], 29, block)]
    assert ring.slot_mapping.tolist() == expected
    # Row 1's first query (position 29) reads 27..29: from logical block 6 on, i.e. ring block 6 % 3 = 0.
    assert ring.first_pos.tolist() == [0, 24]
    assert ring.block_tables.tolist() == [[9, 2], [4, 1]]
    assert inputs.slot_mapping.tolist()[:5] == [0, 1, 2, 3, 4]  # the full pool's slots are unchanged


def test_pack_step_refuses_a_chunk_that_would_wrap_onto_live_positions():
    fits = SequenceChunk(list(range(6)), past_len=10, block_table=list(range(4)), window_ring=[0, 1])
    assert (
        pack_step([fits], 4, window=3).window is not None
    )  # 6 new + 2 read = 8 live slots: exactly the ring
    too_long = SequenceChunk(list(range(7)), past_len=10, block_table=list(range(5)), window_ring=[0, 1])
    with pytest.raises(ValueError, match="need 9 live slots but its ring holds 8"):
        pack_step([too_long], 4, window=3)
    with pytest.raises(ValueError, match="no window ring"):
        pack_step([SequenceChunk([1], 0, [0])], 4, window=3)


# ---- the window pool -------------------------------------------------------------------------------------


def test_window_ring_spec_validates_and_sizes_one_ring_per_resident():
    spec = WindowRingSpec.for_residents(window=8, chunk_size=5, block_size=4, max_residents=3)
    assert (spec.ring_blocks, spec.num_blocks) == (3, 9)
    with pytest.raises(ValueError, match="cannot hold one ring"):
        WindowRingSpec(8, 5, 4, 2)
    with pytest.raises(ValueError, match="window must be positive"):
        WindowRingSpec(0, 5, 4, 9)


def manager(num_blocks=16, rings=2, max_batch_size=3) -> PagedCacheManager:
    spec = WindowRingSpec(window=8, chunk_size=5, block_size=4, num_blocks=3 * rings)  # R = 3
    return PagedCacheManager(num_blocks, 4, max_batch_size, window=spec)


def test_admission_takes_one_ring_and_growth_none():
    m = manager()
    reservation = m.reserve([CacheCandidate("a", 6, True)])
    assert reservation.window_ring("a") == (0, 1, 2) and reservation.reserved_window_blocks() == (0, 1, 2)
    reservation.commit({"a": 5})
    assert m.window_ring("a") == (0, 1, 2)
    reservation = m.reserve([CacheCandidate("a", 40, False), CacheCandidate("b", 1, True)])
    assert reservation.window_ring("a") == (0, 1, 2) and reservation.window_ring("b") == (3, 4, 5)
    reservation.commit()
    stats = m.stats()
    assert (stats.window_total_blocks, stats.window_free_blocks, stats.window_owned_blocks) == (6, 0, 6)
    assert stats.window_blocks_per_request == {"a": 3, "b": 3}
    assert stats.blocks_per_request == {"a": 10, "b": 1}  # the full pool grows, the rings do not
    assert validate_cache(m) == []


def test_planning_defers_an_admission_when_no_ring_is_free():
    m = manager(rings=1)
    m.reserve([CacheCandidate("a", 4, True)]).commit()
    plan = m.plan_step_resources([CacheCandidate("a", 5, False), CacheCandidate("b", 4, True)])
    assert [c.request_id for c in plan.selected] == ["a"]
    assert plan.deferred == ((CacheCandidate("b", 4, True), DeferReason.CAPACITY_DEFERRED),)
    assert (plan.new_blocks, plan.new_window_blocks) == (1, 0)  # a grows into a second block
    m.deallocate("a")
    plan = m.plan_step_resources([CacheCandidate("b", 4, True)])
    assert (plan.new_blocks, plan.new_window_blocks) == (1, 3)


def test_reserve_is_all_or_nothing_across_both_pools():
    m = manager(rings=1)
    m.reserve([CacheCandidate("a", 4, True)]).commit()
    before = (m.pool.free_list(), m.window_pool.free_list())
    generation = m.pool.generation
    with pytest.raises(CacheError, match="only 0 of 3 window blocks free"):
        m.reserve([CacheCandidate("b", 8, True)])  # full blocks are free, no ring is
    assert (m.pool.free_list(), m.window_pool.free_list()) == before and m.pool.generation == generation
    assert m.live_reservation is None and validate_cache(m) == []


def test_discard_and_deallocate_return_both_pools():
    m = manager()
    m.reserve([CacheCandidate("a", 4, True)]).commit()
    reservation = m.reserve([CacheCandidate("a", 9, False), CacheCandidate("b", 4, True)])
    assert validate_cache(m) == []
    reservation.discard()
    assert m.stats().window_free_blocks == 3 and m.window_ring("a") == (0, 1, 2)
    assert not m.is_resident("b") and validate_cache(m) == []
    assert m.deallocate("a")
    stats = m.stats()
    assert (stats.free_blocks, stats.window_free_blocks) == (16, 6) and validate_cache(m) == []


def test_commit_refuses_a_window_pool_mutated_behind_the_reservation():
    m = manager()
    reservation = m.reserve([CacheCandidate("a", 4, True)])
    stray = m.window_pool.reserve(1)
    m.window_pool.return_reserved(stray)
    with pytest.raises(CacheError, match="window block pool changed"):
        reservation.commit()
    reservation.discard()
    assert validate_cache(m) == []


def test_validator_sees_a_wrong_ring_and_a_shared_window_block():
    m = manager()
    m.reserve([CacheCandidate("a", 4, True), CacheCandidate("b", 4, True)]).commit()
    tables = m._tables
    tables["b"].window_blocks[0] = tables["a"].window_blocks[0]
    problems = validate_cache(m)
    assert any("window block 0 is owned by both 'a' and 'b'" in p for p in problems)
    assert any("window block totals" in p or "OWNED but rings hold" in p for p in problems)
    tables["b"].window_blocks[:] = [3, 4]
    assert any("owns 2 window blocks, a ring is 3" in p for p in validate_cache(m))
