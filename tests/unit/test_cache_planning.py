"""Every branch of plan_step_resources, with exact selections and reasons."""

from __future__ import annotations

import pytest

from pagedgen.cache import CacheCandidate, DeferReason, PagedCacheManager
from pagedgen.errors import CacheError

DEFERRED = DeferReason.CAPACITY_DEFERRED
UNSERVICEABLE = DeferReason.UNSERVICEABLE


def new(rid: int, slots: int) -> CacheCandidate:
    return CacheCandidate(rid, slots, is_new=True)


def res(rid: int, slots: int) -> CacheCandidate:
    return CacheCandidate(rid, slots, is_new=False)


def admit(manager: PagedCacheManager, *requests: tuple[int, int]) -> None:
    """Make each ``(request_id, slots)`` resident with ``slots`` committed slots."""
    manager.reserve([new(rid, slots) for rid, slots in requests]).commit()


def snapshot(manager: PagedCacheManager) -> tuple:
    return (
        manager.pool.generation,
        manager.pool.free_list(),
        {rid: (manager.block_table(rid), manager.committed_slots(rid)) for rid in manager.resident_ids()},
    )


def test_everything_fits_and_order_is_kept() -> None:
    manager = PagedCacheManager(num_blocks=8, block_size=4, max_batch_size=4)
    admit(manager, (1, 4), (2, 3))
    candidates = [res(2, 4), res(1, 5), new(3, 6)]
    plan = manager.plan_step_resources(candidates)
    assert plan.selected == tuple(candidates)
    assert plan.deferred == ()
    assert plan.new_blocks == 1 + 2  # request 1 crosses into a 2nd block; request 3 needs 2 blocks


def test_decode_first_order_kept_when_capacity_runs_out() -> None:
    manager = PagedCacheManager(num_blocks=4, block_size=2, max_batch_size=4)
    admit(manager, (1, 2), (2, 2))  # blocks 0, 1 owned; 2 free
    candidates = [res(2, 3), res(1, 3), new(3, 1)]  # decodes first, each needs one new block
    plan = manager.plan_step_resources(candidates)
    assert plan.selected == (res(2, 3), res(1, 3))
    assert plan.deferred == ((new(3, 1), DEFERRED),)
    assert plan.new_blocks == 2


def test_skip_and_continue_past_a_blocked_prefill() -> None:
    manager = PagedCacheManager(num_blocks=6, block_size=4, max_batch_size=4)
    admit(manager, (1, 4), (2, 4))  # 4 blocks free
    candidates = [res(1, 5), new(3, 17), new(4, 8), res(2, 5)]  # request 3 needs 5 blocks; 3 remain
    plan = manager.plan_step_resources(candidates)
    assert plan.selected == (res(1, 5), new(4, 8), res(2, 5))
    assert plan.deferred == ((new(3, 17), DEFERRED),)
    assert plan.new_blocks == 1 + 2 + 1


def test_unserviceable_larger_than_the_whole_pool_vs_deferred() -> None:
    manager = PagedCacheManager(num_blocks=4, block_size=4, max_batch_size=4)
    admit(manager, (1, 8))  # 2 blocks owned, 2 free
    candidates = [new(2, 17), new(3, 16), new(4, 8)]
    plan = manager.plan_step_resources(candidates)
    assert plan.selected == (new(4, 8),)
    assert plan.deferred == ((new(2, 17), UNSERVICEABLE), (new(3, 16), DEFERRED))
    assert plan.unserviceable == (new(2, 17),)
    assert plan.capacity_deferred == (new(3, 16),)


def test_resident_that_outgrows_the_pool_is_unserviceable() -> None:
    manager = PagedCacheManager(num_blocks=2, block_size=2, max_batch_size=2)
    admit(manager, (1, 4))
    plan = manager.plan_step_resources([res(1, 5)])
    assert plan.selected == ()
    assert plan.deferred == ((res(1, 5), UNSERVICEABLE),)


def test_block_table_width_limit_is_unserviceable_even_with_free_blocks() -> None:
    manager = PagedCacheManager(num_blocks=16, block_size=4, max_batch_size=4, max_blocks_per_table=3)
    admit(manager, (1, 12))
    candidates = [res(1, 13), new(2, 13), new(3, 12)]
    plan = manager.plan_step_resources(candidates)
    assert plan.selected == (new(3, 12),)
    assert plan.deferred == ((res(1, 13), UNSERVICEABLE), (new(2, 13), UNSERVICEABLE))
    assert manager.max_servable_slots == 12


def test_residency_limit_counts_idle_residents() -> None:
    manager = PagedCacheManager(num_blocks=16, block_size=4, max_batch_size=3)
    admit(manager, (1, 4), (2, 4))  # two residents; request 2 idle (turn complete): not a candidate
    candidates = [res(1, 5), new(3, 4), new(4, 4)]
    plan = manager.plan_step_resources(candidates)
    assert plan.selected == (res(1, 5), new(3, 4))
    assert plan.deferred == ((new(4, 4), DEFERRED),)


def test_residency_full_still_lets_residents_run() -> None:
    manager = PagedCacheManager(num_blocks=16, block_size=4, max_batch_size=2)
    admit(manager, (1, 4), (2, 4))
    plan = manager.plan_step_resources([new(3, 1), res(2, 5)])
    assert plan.selected == (res(2, 5),)
    assert plan.deferred == ((new(3, 1), DEFERRED),)


def test_row_limit_defers_the_rest_but_still_reports_unserviceable() -> None:
    manager = PagedCacheManager(num_blocks=16, block_size=4, max_batch_size=8)
    admit(manager, (1, 4), (2, 4), (3, 4))
    candidates = [res(1, 5), res(2, 5), res(3, 5), new(4, 65)]
    plan = manager.plan_step_resources(candidates, max_rows=2)
    assert plan.selected == (res(1, 5), res(2, 5))
    assert plan.deferred == ((res(3, 5), DEFERRED), (new(4, 65), UNSERVICEABLE))


def test_rows_never_exceed_max_batch_size_even_if_max_rows_is_larger() -> None:
    manager = PagedCacheManager(num_blocks=16, block_size=4, max_batch_size=2)
    plan = manager.plan_step_resources([new(1, 1), new(2, 1), new(3, 1)], max_rows=10)
    assert plan.selected == (new(1, 1), new(2, 1))
    assert plan.deferred == ((new(3, 1), DEFERRED),)


def test_whole_prompt_is_reserved_at_admission_and_later_chunks_need_no_blocks() -> None:
    manager = PagedCacheManager(num_blocks=5, block_size=4, max_batch_size=2)
    plan = manager.plan_step_resources([new(1, 10)])  # a 10-token prompt: 3 blocks, whatever the chunk
    assert plan.new_blocks == 3
    reservation = manager.reserve(plan.selected)
    assert reservation.block_table(1) == (0, 1, 2)
    reservation.commit({1: 4})  # the first chunk ran 4 tokens
    assert (manager.block_table(1), manager.committed_slots(1)) == ((0, 1, 2), 4)
    # The rest of the prompt needs no new block, so a competing prompt cannot take the capacity.
    plan = manager.plan_step_resources([res(1, 10), new(2, 9)])
    assert plan.selected == (res(1, 10),)
    assert plan.deferred == ((new(2, 9), DEFERRED),)
    assert plan.new_blocks == 0


def test_candidate_with_no_growth_fits_in_a_full_pool() -> None:
    manager = PagedCacheManager(num_blocks=2, block_size=4, max_batch_size=2)
    admit(manager, (1, 5))
    assert manager.pool.num_free == 0
    plan = manager.plan_step_resources([res(1, 8), new(2, 1)])
    assert plan.selected == (res(1, 8),)
    assert plan.deferred == ((new(2, 1), DEFERRED),)


def test_planning_never_mutates() -> None:
    manager = PagedCacheManager(num_blocks=4, block_size=2, max_batch_size=3)
    admit(manager, (1, 2), (2, 1))
    before = snapshot(manager)
    manager.plan_step_resources([res(1, 3), res(2, 2), new(3, 40), new(4, 3)], max_rows=2)
    assert snapshot(manager) == before
    assert manager.live_reservation is None


@pytest.mark.parametrize(
    ("candidates", "match"),
    [
        ([new(1, 1)], "already resident"),
        ([res(7, 1)], "owns no block table"),
        ([res(1, 3)], "below its 4 committed"),
        ([new(5, 1), new(5, 2)], "twice"),
        ([new(5, 0)], ">= 1"),
        ([CacheCandidate(5, 1.5, True)], "must be an int"),  # type: ignore[arg-type]
    ],
)
def test_planning_rejects_candidates_that_contradict_committed_state(
    candidates: list[CacheCandidate], match: str
) -> None:
    manager = PagedCacheManager(num_blocks=4, block_size=2, max_batch_size=3)
    admit(manager, (1, 4))
    before = snapshot(manager)
    with pytest.raises(CacheError, match=match):
        manager.plan_step_resources(candidates)
    assert snapshot(manager) == before


def test_planning_rejects_nonpositive_max_rows_and_a_live_reservation() -> None:
    manager = PagedCacheManager(num_blocks=4, block_size=2, max_batch_size=3)
    with pytest.raises(CacheError, match="max_rows"):
        manager.plan_step_resources([new(1, 1)], max_rows=0)
    manager.reserve([new(1, 1)])
    with pytest.raises(CacheError, match="reservation is live"):
        manager.plan_step_resources([new(2, 1)])


def test_empty_candidate_list_plans_nothing() -> None:
    manager = PagedCacheManager(num_blocks=4, block_size=2, max_batch_size=3)
    plan = manager.plan_step_resources([])
    assert (plan.selected, plan.deferred, plan.new_blocks) == ((), (), 0)
