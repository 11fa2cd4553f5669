"""Random interleavings of admit / grow / reserve / commit / discard / deallocate keep the cache consistent.

A shadow model (request -> committed slots and exact block ids, plus the expected free list) is advanced by
hand next to the manager; after every operation the invariant validator must find nothing and the manager
must agree with the shadow exactly. Planning is checked against an independent greedy re-computation.
Releasing every request must give back a pool whose blocks are all free.

Half the machines also have a window-ring pool (sliding-window layers): each admission then takes one ring
from it, which the shadow tracks as separately (its own free list, rings per request) as the full pool.
"""

from __future__ import annotations

from collections.abc import Hashable

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pagedgen.cache import CacheCandidate, DeferReason, PagedCacheManager, WindowRingSpec, blocks_for_tokens
from pagedgen.core.window_geometry import ring_blocks
from pagedgen.engine.invariants import validate_cache
from pagedgen.errors import CacheError


class CacheMachine(RuleBasedStateMachine):
    manager: PagedCacheManager | None = None

    @initialize(
        num_blocks=st.integers(1, 64),
        block_size=st.integers(1, 16),
        max_batch_size=st.integers(1, 6),
        max_width=st.none() | st.integers(1, 20),
        window=st.none() | st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 3)),
    )
    def setup(
        self,
        num_blocks: int,
        block_size: int,
        max_batch_size: int,
        max_width: int | None,
        window: tuple[int, int, int] | None,
    ) -> None:
        spec = None
        if window is not None:  # (window, chunk, spare rings): the pool may hold fewer rings than residents
            size, chunk, spare = window
            ring = ring_blocks(chunk, size, block_size)
            spec = WindowRingSpec(size, chunk, block_size, ring * max(1, max_batch_size - spare))
        self.manager = PagedCacheManager(num_blocks, block_size, max_batch_size, max_width, spec)
        self.committed: dict[Hashable, tuple[int, tuple[int, ...]]] = {}  # rid -> (slots, blocks)
        self.free: list[int] = list(range(num_blocks))  # the expected free list, in hand-out order
        self.rings: dict[Hashable, tuple[int, ...]] = {}  # rid -> committed window ring
        self.window_free: list[int] = [] if spec is None else list(range(spec.num_blocks))
        self.reservation = None
        self.stale = False  # the pool was mutated behind the live reservation
        self.next_id = 0
        self.released: list[int] = []

    # ---- helpers ----

    def _live(self) -> bool:
        return self.reservation is not None

    def _new_id(self, data: st.DataObject) -> int:
        if self.released and data.draw(st.booleans()):
            return self.released.pop(data.draw(st.integers(0, len(self.released) - 1)))
        self.next_id += 1
        return self.next_id

    def _required(self, data: st.DataObject) -> int:
        bs = self.manager.block_size
        return data.draw(st.integers(1, 3 * bs) | st.integers(1, bs * (self.manager.num_blocks + 2)))

    def _expected_plan(self, candidates: list[CacheCandidate], max_rows: int | None) -> tuple[list, list]:
        """Greedy re-computation of the planner from the shadow model."""
        m = self.manager
        limit = m.num_blocks if m.max_blocks_per_table is None else min(m.num_blocks, m.max_blocks_per_table)
        rows = m.max_batch_size if max_rows is None else min(max_rows, m.max_batch_size)
        free, residents, selected, deferred = len(self.free), len(self.committed), [], []
        window_free = len(self.window_free)
        for c in candidates:
            width = blocks_for_tokens(c.required_slots, m.block_size)
            owned = 0 if c.is_new else len(self.committed[c.request_id][1])
            ring = m.ring_blocks if c.is_new else 0
            if width > limit:
                deferred.append((c, DeferReason.UNSERVICEABLE))
            elif (
                len(selected) >= rows
                or (c.is_new and residents >= m.max_batch_size)
                or width - owned > free
                or ring > window_free
            ):
                deferred.append((c, DeferReason.CAPACITY_DEFERRED))
            else:
                selected.append(c)
                free -= max(0, width - owned)
                window_free -= ring
                residents += 1 if c.is_new else 0
        return selected, deferred

    def _plan_and_reserve(
        self,
        data: st.DataObject,
        candidates: list[CacheCandidate],
        shuffle: bool = True,
        reserve: bool = False,
    ) -> None:
        """Plan (checked against the greedy oracle); reserve the plan if ``reserve`` or a draw says so."""
        if shuffle:
            candidates = data.draw(st.permutations(candidates))
        max_rows = data.draw(st.none() | st.integers(1, 6))
        plan = self.manager.plan_step_resources(candidates, max_rows)
        selected, deferred = self._expected_plan(candidates, max_rows)
        assert list(plan.selected) == selected
        assert list(plan.deferred) == deferred
        for _, reason in plan.deferred:
            event(f"plan: {reason.value}")
        if not plan.selected or not (reserve or data.draw(st.booleans(), label="reserve")):
            return
        reservation = self.manager.reserve(plan.selected)
        taken, self.free = self.free[: plan.new_blocks], self.free[plan.new_blocks :]
        assert reservation.reserved_blocks() == tuple(taken)
        rings, self.window_free = (
            self.window_free[: plan.new_window_blocks],
            self.window_free[plan.new_window_blocks :],
        )
        assert reservation.reserved_window_blocks() == tuple(rings)
        start = ring_start = 0
        r = self.manager.ring_blocks
        for c in plan.selected:
            slots, blocks = self.committed.get(c.request_id, (0, ()))
            grow = max(0, blocks_for_tokens(c.required_slots, self.manager.block_size) - len(blocks))
            assert reservation.block_table(c.request_id) == blocks + tuple(taken[start : start + grow])
            assert reservation.committed_slots(c.request_id) == slots
            start += grow
            if c.is_new:
                assert reservation.window_ring(c.request_id) == tuple(rings[ring_start : ring_start + r])
                ring_start += r
            else:
                assert reservation.window_ring(c.request_id) == self.rings[c.request_id]
        self.reservation = reservation
        event("reserve")

    # ---- operations ----
    # Every rule is always enabled and branches on state: with preconditions, hypothesis' swarm feature flags
    # often disable every rule a state allows and throw the example away.

    def _refused_while_live(self, data: st.DataObject) -> None:
        before = (self.manager.pool.generation, self.manager.pool.free_list())
        with pytest.raises(CacheError, match="reservation is live"):
            self.manager.plan_step_resources([CacheCandidate(self._new_id(data), 1, True)])
        with pytest.raises(CacheError, match="reservation is live"):
            self.manager.reserve([CacheCandidate(self._new_id(data), 1, True)])
        assert (self.manager.pool.generation, self.manager.pool.free_list()) == before

    @rule(data=st.data(), count=st.integers(1, 3))
    def admit(self, data: st.DataObject, count: int) -> None:
        """Plan and maybe reserve new requests only (refused while a reservation is live)."""
        if self._live():
            return self._refused_while_live(data)
        candidates = [CacheCandidate(self._new_id(data), self._required(data), True) for _ in range(count)]
        self._plan_and_reserve(data, candidates)

    @rule(data=st.data())
    def grow(self, data: st.DataObject) -> None:
        """Plan and maybe reserve growth (decode or prefill continuation) of some residents."""
        if self._live():
            return self._refused_while_live(data)
        rids = (
            data.draw(st.lists(st.sampled_from(list(self.committed)), unique=True)) if self.committed else []
        )
        bs = self.manager.block_size
        candidates = [
            CacheCandidate(rid, max(1, self.committed[rid][0] + data.draw(st.integers(0, 2 * bs + 1))), False)
            for rid in rids
        ]
        self._plan_and_reserve(data, candidates)

    def _mixed_candidates(self, data: st.DataObject) -> list[CacheCandidate]:
        """Decodes of some residents followed by new prefills, as the scheduler orders them."""
        rids = (
            data.draw(st.lists(st.sampled_from(list(self.committed)), unique=True)) if self.committed else []
        )
        candidates = [CacheCandidate(rid, self.committed[rid][0] + 1, False) for rid in rids]
        for _ in range(data.draw(st.integers(0, 2))):
            candidates.append(CacheCandidate(self._new_id(data), self._required(data), True))
        return candidates

    @rule(data=st.data())
    def mixed_step(self, data: st.DataObject) -> None:
        """Plan and maybe reserve decodes and admissions together."""
        if self._live():
            return self._refused_while_live(data)
        self._plan_and_reserve(data, self._mixed_candidates(data), shuffle=False)

    @rule(data=st.data())
    def engine_step(self, data: st.DataObject) -> None:
        """A whole engine step: plan, reserve and commit (or finish the live reservation first)."""
        if not self._live():
            self._plan_and_reserve(data, self._mixed_candidates(data), shuffle=False, reserve=True)
        self.commit(data)

    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        """Commit the live reservation, narrowing some rows; a stale one must be refused, then discarded."""
        reservation = self.reservation
        if reservation is None:
            return
        if self.stale:
            with pytest.raises(CacheError, match="block pool changed"):
                reservation.commit()
            event("commit: stale, refused")
            return self.discard()
        advance = {}
        for row in reservation.rows:
            if data.draw(st.booleans(), label="narrow"):
                advance[row.request_id] = data.draw(st.integers(row.committed_slots, row.required_slots))
        event("commit: narrowed" if advance else "commit: full")
        reservation.validate_commit(advance)
        reservation.commit(advance)
        for row in reservation.rows:
            self.committed[row.request_id] = (advance.get(row.request_id, row.required_slots), row.blocks)
            self.rings[row.request_id] = row.window_ring
        self.reservation = None

    @rule()
    def discard(self) -> None:
        """Roll back the live reservation: its blocks go to the back of the free list."""
        if self.reservation is None:
            return
        self.free += list(self.reservation.reserved_blocks())
        self.window_free += list(self.reservation.reserved_window_blocks())
        self.reservation.discard()
        self.reservation = None
        self.stale = False

    @rule(window=st.booleans())
    def mutate_pool(self, window: bool) -> None:
        """Take and return a free block of one pool directly: any live reservation is stale from then on."""
        free = self.window_free if window else self.free
        pool = self.manager.window_pool if window else self.manager.pool
        if not free or pool is None:
            return
        stray = pool.reserve(1)
        if self._live():
            with pytest.raises(CacheError, match="block pool changed"):
                self.reservation.validate_commit()
            self.stale = True
        pool.return_reserved(stray)
        free[:] = free[1:] + list(stray)

    @rule(data=st.data())
    def deallocate(self, data: st.DataObject) -> None:
        """Release a resident (refused while live); releasing a non-resident reports False."""
        rid = data.draw(st.sampled_from(list(self.committed))) if self.committed else self.next_id + 1
        if self._live():
            with pytest.raises(CacheError, match="reservation is live"):
                self.manager.deallocate(rid)
            return
        if not self.committed:
            assert self.manager.deallocate(rid) is False
            return
        assert self.manager.deallocate(rid) is True
        assert self.manager.deallocate(rid) is False
        self.free += list(self.committed.pop(rid)[1])
        self.window_free += list(self.rings.pop(rid))
        self.released.append(rid)

    # ---- checks ----

    @invariant()
    def consistent(self) -> None:
        if self.manager is None:
            return
        m = self.manager
        assert validate_cache(m) == []
        assert m.resident_ids() == tuple(self.committed)
        for rid, (slots, blocks) in self.committed.items():
            assert (m.committed_slots(rid), m.block_table(rid)) == (slots, blocks)
        assert m.pool.free_list() == tuple(self.free)
        stats = m.stats()
        reserved = 0 if self.reservation is None else self.reservation.num_reserved_blocks
        assert (stats.free_blocks, stats.reserved_blocks) == (len(self.free), reserved)
        assert stats.blocks_per_request == {rid: len(b) for rid, (_, b) in self.committed.items()}
        for rid, ring in self.rings.items():
            assert m.window_ring(rid) == ring
        if m.window_pool is not None:
            assert m.window_pool.free_list() == tuple(self.window_free)
            reserved = 0 if self.reservation is None else self.reservation.num_reserved_window_blocks
            assert (stats.window_free_blocks, stats.window_reserved_blocks) == (
                len(self.window_free),
                reserved,
            )
            assert stats.window_blocks_per_request == {rid: len(r) for rid, r in self.rings.items()}

    def teardown(self) -> None:
        if self.manager is None:
            return
        if self.reservation is not None:
            self.reservation.discard()
        for rid in list(self.committed):
            assert self.manager.deallocate(rid)
        assert validate_cache(self.manager) == []
        assert sorted(self.manager.pool.free_list()) == list(range(self.manager.num_blocks))
        event(f"teardown: released {len(self.committed)} residents")
        stats = self.manager.stats()
        assert stats.free_blocks == self.manager.num_blocks
        assert stats.window_free_blocks == stats.window_total_blocks


CacheMachine.TestCase.settings = settings(max_examples=2000, stateful_step_count=20)
test_cache_state_machine = CacheMachine.TestCase
