"""The fixed-state pool: two banks, validate / prepare / publish, direct and gathered bindings, rollback.

docs/cache.md, "Fixed state". A tiny "model" (:func:`run_step`) turns each row's input state into
its output state with a formula that depends on the row's request and target tokens, so every test can say
exactly which state a slot must hold. No engine and no real model here: the engine-level proofs are the
hybrid synthetic model's (tests/synthetic) and LFM2's (tests/model).
"""

from __future__ import annotations

import pytest
import torch

from pagedgen.cache import CacheCandidate, FixedStatePool, PagedCacheManager, PlanLimits, plan_resources
from pagedgen.cache.fixed_state_pool import FixedReservationState
from pagedgen.core.fixed_state_spec import FixedStateSpec
from pagedgen.core.state_manifest import StateKind
from pagedgen.errors import CacheError
from tests.helpers import fixed_snapshot

SPECS = (
    FixedStateSpec("conv.1", StateKind.FIXED_CONV, 1, (2, 3)),
    FixedStateSpec("rec.3", StateKind.FIXED_RECURRENT, 3, (4,), torch.float64),
)


def run_step(reservation, rows):
    """Write every row's next state: ``input * 2 + request id + target`` (any lost or doubled step shows)."""
    bindings = reservation.bindings
    for name, out in bindings.outputs.items():
        bump = torch.tensor([rid + target for rid, target in rows], dtype=out.dtype)
        out.copy_(bindings.inputs[name] * 2 + bump.view(-1, *([1] * (out.dim() - 1))))


def expected(history, rid):
    """The state ``run_step`` gives request ``rid`` after its targets in ``history``, from zeros."""
    value = 0.0
    for target in history:
        value = value * 2 + rid + target
    return value


def step(pool, rows):
    reservation = pool.reserve(rows)
    run_step(reservation, rows)
    reservation.commit(dict(rows))
    return reservation


def test_a_step_reads_the_active_bank_writes_the_other_and_publishes_only_at_commit():
    pool = FixedStatePool(SPECS, capacity=3)
    first = step(pool, [(7, 3)])
    assert not first.direct and first.rows[0].is_new  # an admission gathers zeros
    assert pool.owners() == {7: 0} and pool.committed_tokens(7) == 3
    slot = pool.slot(0)
    assert (slot.allocation_generation, slot.state_generation) == (1, 1)
    assert torch.equal(pool.state(7)["conv.1"], torch.full((2, 3), expected([3], 7)))
    before = pool.state(7)
    reservation = pool.reserve([(7, 5)])
    assert reservation.direct and reservation.bindings.inputs["conv.1"].data_ptr() != (
        reservation.bindings.outputs["conv.1"].data_ptr()
    )
    run_step(reservation, [(7, 5)])
    reservation.prepare_commit({7: 5})
    assert all(torch.equal(pool.state(7)[n], before[n]) for n in before)  # prepared is still invisible
    assert pool.committed_tokens(7) == 3
    reservation.publish_commit()
    assert pool.state(7)["rec.3"].tolist() == [expected([3, 5], 7)] * 4 and pool.committed_tokens(7) == 5
    assert pool.slot(0).state_generation == 2 and pool.live_reservation is None


@pytest.mark.parametrize("prepared", [False, True])
def test_discard_leaves_every_slot_byte_identical_and_frees_only_provisional_slots(prepared):
    pool = FixedStatePool(SPECS, capacity=4)
    step(pool, [(1, 2), (2, 4)])
    step(pool, [(2, 6)])  # the two residents now have different active banks
    before = fixed_snapshot(pool)
    for rows in ([(1, 3), (2, 7)], [(2, 7), (9, 1), (1, 3)]):  # direct (normalised), then gathered
        reservation = pool.reserve(rows)
        run_step(reservation, rows)
        if prepared:
            reservation.prepare_commit(dict(rows))
        reservation.discard()
        assert reservation.state is FixedReservationState.DISCARDED
        assert fixed_snapshot(pool) == before and pool.live_reservation is None
    reservation.discard()  # idempotent


def test_direct_and_gathered_paths_give_identical_state():
    history = [[(1, 2), (2, 3), (3, 1)], [(1, 3)], [(3, 2)], [(1, 5), (2, 6), (3, 3)]]
    direct, gathered = FixedStatePool(SPECS, capacity=4), FixedStatePool(SPECS, capacity=4)
    gathered._is_interval = lambda ids, slots: False  # this pool never binds banks directly
    paths = []
    for rows in history:
        paths.append(step(direct, rows).direct)
        assert not step(gathered, rows).direct
    assert paths == [False, True, True, True]  # the last one first normalises slot 1 (the minority bank)
    assert [direct.slot(i).active for i in range(3)] == [1, 1, 1]
    for rid in (1, 2, 3):
        targets = [t for rows in history for r, t in rows if r == rid]
        for name in ("conv.1", "rec.3"):
            assert torch.equal(direct.state(rid)[name], gathered.state(rid)[name])
            assert direct.state(rid)[name].flatten()[0].item() == expected(targets, rid)


def test_a_fragmented_batch_is_gathered_and_an_admission_starts_from_zeros():
    pool = FixedStatePool(SPECS, capacity=4)
    step(pool, [(1, 2), (2, 2), (3, 2)])
    reservation = pool.reserve([(1, 3), (3, 3)])  # slots 0 and 2: not an interval
    assert not reservation.direct
    reservation.discard()
    pool.release(2)  # slot 1 returns, its banks keep the old state
    reservation = pool.reserve([(4, 1)])
    assert reservation.rows[0].slot == 1 and not reservation.direct
    assert all(t.abs().sum() == 0 for t in reservation.bindings.inputs.values())
    run_step(reservation, [(4, 1)])
    reservation.commit({4: 1})
    assert pool.slot(1).allocation_generation == 2 and pool.state(4)["rec.3"][0].item() == expected([1], 4)


def test_refusals_change_nothing():
    pool = FixedStatePool(SPECS, capacity=2)
    step(pool, [(1, 2)])
    before = fixed_snapshot(pool)
    with pytest.raises(CacheError, match="does not advance"):
        pool.reserve([(1, 2)])
    with pytest.raises(CacheError, match="twice"):
        pool.reserve([(5, 1), (5, 1)])
    with pytest.raises(CacheError, match="2 admissions need fixed-state slots, only 1"):
        pool.reserve([(5, 1), (6, 1)])
    assert fixed_snapshot(pool) == before
    reservation = pool.reserve([(1, 4), (5, 2)])
    with pytest.raises(CacheError, match="while a reservation is live"):
        pool.reserve([(1, 5)])
    with pytest.raises(CacheError, match="while a reservation is live"):
        pool.release(1)
    with pytest.raises(CacheError, match="not narrowed"):
        reservation.validate_commit({1: 3})
    with pytest.raises(CacheError, match="prepare it first"):
        reservation.publish_commit()
    run_step(reservation, [(1, 4), (5, 2)])
    reservation.commit({1: 4, 5: 2})
    with pytest.raises(CacheError, match="cannot discard a committed"):
        reservation.discard()
    with pytest.raises(CacheError, match="cannot commit a committed"):
        reservation.validate_commit()


def test_a_failed_prepare_keeps_committed_state_returns_admissions_and_makes_the_pool_unhealthy(monkeypatch):
    pool = FixedStatePool(SPECS, capacity=3)
    step(pool, [(1, 2)])
    before = fixed_snapshot(pool)
    reservation = pool.reserve([(5, 3), (1, 4)])

    def broken(rows):
        raise RuntimeError("device copy failed")

    monkeypatch.setattr(pool, "_write_back", broken)
    with pytest.raises(RuntimeError, match="device copy failed"):
        reservation.prepare_commit({5: 3, 1: 4})
    assert reservation.state is FixedReservationState.FAILED and pool.live_reservation is None
    reservation.discard()  # a no-op on a failed reservation
    assert fixed_snapshot(pool) == {**before, "healthy": False}
    with pytest.raises(CacheError, match="unhealthy"):
        pool.reserve([(1, 5)])


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="row_shape"):
        FixedStateSpec("x", StateKind.FIXED_CONV, 0, (0, 3))
    with pytest.raises(ValueError, match="fixed_conv or fixed_recurrent"):
        FixedStateSpec("x", StateKind.PAGED_KV, 0, (3,))
    with pytest.raises(ValueError, match="unique"):
        FixedStatePool((SPECS[0], SPECS[0]), capacity=2)
    with pytest.raises(ValueError, match="capacity"):
        FixedStatePool(SPECS, capacity=0)


# ---- composite reservation through the manager ---------------------------------------------------------


def manager(num_blocks=8, max_batch_size=2):
    return PagedCacheManager(
        num_blocks, 4, max_batch_size, fixed=FixedStatePool(SPECS, capacity=max_batch_size)
    )


def test_the_manager_reserves_commits_and_releases_slots_with_blocks():
    cache = manager()
    reservation = cache.reserve([CacheCandidate(1, 6, True)], {1: 3})
    assert reservation.fixed is not None and reservation.fixed_bindings is not None
    run_step(reservation.fixed, [(1, 3)])
    with pytest.raises(CacheError, match="not narrowed"):
        reservation.validate_commit()  # paged default (6 slots) differs from the fixed boundary (3)
    reservation.commit({1: 3})
    assert cache.committed_slots(1) == 3 == cache.fixed.committed_tokens(1)
    assert cache.stats().fixed_free_slots == 1
    reservation = cache.reserve([CacheCandidate(1, 6, False), CacheCandidate(2, 2, True)], {1: 4, 2: 2})
    free_before = cache.stats()
    reservation.discard()
    assert cache.stats().fixed_free_slots == 1 and free_before.fixed_free_slots == 0
    assert cache.deallocate(1) and cache.fixed.owners() == {}
    assert cache.stats().fixed_free_slots == 2 and cache.stats().free_blocks == 8


def test_the_manager_needs_fixed_targets_and_a_failed_block_reservation_frees_the_slots():
    cache = manager(num_blocks=2)
    with pytest.raises(CacheError, match="target token count"):
        cache.reserve([CacheCandidate(1, 4, True)])
    with pytest.raises(CacheError, match="only 2 of 2 free"):
        cache.reserve([CacheCandidate(1, 4, True), CacheCandidate(2, 8, True)], {1: 4, 2: 8})
    assert cache.stats().fixed_free_slots == 2 and cache.fixed.live_reservation is None


def test_planning_defers_an_admission_when_no_fixed_slot_is_free():
    limits = PlanLimits(
        block_size=4,
        total_blocks=8,
        free_blocks=8,
        max_batch_size=4,
        max_rows=4,
        max_blocks_per_table=None,
        fixed_free_slots=1,
    )
    plan = plan_resources([CacheCandidate(1, 4, True), CacheCandidate(2, 4, True)], {}, limits)
    assert [c.request_id for c in plan.selected] == [1] and [
        c.request_id for c in plan.capacity_deferred
    ] == [2]


def test_the_invariants_see_fixed_ownership_drift_from_the_paged_residents():
    from pagedgen.engine.invariants import validate_cache

    cache = manager()
    reservation = cache.reserve([CacheCandidate(1, 3, True)], {1: 3})
    run_step(reservation.fixed, [(1, 3)])
    reservation.commit({1: 3})
    assert validate_cache(cache) == []
    cache.fixed.release(1)  # behind the manager's back
    problems = validate_cache(cache)
    assert any("are not the paged residents" in p for p in problems)
