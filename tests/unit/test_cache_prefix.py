"""Prefix caching in the cache layer: hash chaining, reference counts, LRU eviction, exact rollback.

Exact block ids throughout: a fresh pool hands out 0, 1, 2, ... and the LRU list order is the eviction order.
"""

from __future__ import annotations

import pytest

from pagedgen.cache import CacheCandidate, PagedCacheManager
from pagedgen.cache.block_pool import BlockPool, BlockState
from pagedgen.cache.prefix import BlockHashes, PrefixCache, block_hash
from pagedgen.engine.invariants import validate_cache, validate_prefix_content
from pagedgen.errors import CacheError

BS = 4


def manager(num_blocks: int = 12, max_batch_size: int = 4) -> PagedCacheManager:
    return PagedCacheManager(num_blocks, BS, max_batch_size, prefix_caching=True)


def new(rid, tokens: list[int]) -> CacheCandidate:
    return CacheCandidate(rid, len(tokens), True, BlockHashes(tokens, BS))


def admit(m: PagedCacheManager, rid, tokens: list[int]):
    """Plan, reserve and commit one admission of its whole sequence; returns the committed reservation."""
    plan = m.plan_step_resources([new(rid, tokens)])
    assert [c.request_id for c in plan.selected] == [rid]
    reservation = m.reserve(plan.selected)
    reservation.commit()
    assert validate_cache(m) == []
    return reservation


def state(m: PagedCacheManager) -> dict:
    return {
        "tables": {rid: (tuple(t.blocks), t.committed_slots) for rid, t in m.tables().items()},
        "free": sorted(m.pool.free_list()),  # a discard returns blocks to the back: order is not state
        "lru": m.pool.cached_stamps(),
        "names": m.prefix.entries(),
        "refs": m.pool.refcounts(),
        "states": m.pool.states(),
    }


# ---- hash chaining ----


def test_a_block_digest_chains_over_its_parent_and_tokens() -> None:
    first = block_hash(None, [1, 2, 3, 4])
    assert first == block_hash(None, [1, 2, 3, 4]) and len(first) == 16
    assert block_hash(None, [1, 2, 3, 5]) != first
    assert block_hash(None, [1, 2, 3, 4], salt=b"other model") != first
    second = block_hash(first, [5, 6, 7, 8])
    assert block_hash(block_hash(None, [0, 2, 3, 4]), [5, 6, 7, 8]) != second  # same tokens, other parent
    assert block_hash(None, [5, 6, 7, 8]) != second  # the first block is not a child of nothing


def test_block_hashes_cover_full_blocks_only_and_grow_with_the_sequence() -> None:
    tokens = [1, 2, 3, 4, 5, 6]
    hashes = BlockHashes(tokens, BS)
    assert hashes.num_full_blocks == 1
    assert hashes.upto(1) == [block_hash(None, [1, 2, 3, 4])]
    with pytest.raises(CacheError, match="block 1 is not full"):
        hashes.upto(2)
    tokens += [7, 8]
    assert hashes[1] == block_hash(hashes[0], [5, 6, 7, 8])
    other = BlockHashes([1, 2, 3, 4, 5, 6, 7, 9], BS)
    assert other[0] == hashes[0] and other[1] != hashes[1]


def test_match_stops_at_the_first_missing_block() -> None:
    cache = PrefixCache()
    hashes = BlockHashes(list(range(12)), BS)
    cache.publish(7, hashes[0])
    cache.publish(9, hashes[2])  # block 1 is not cached, so block 2 cannot be reached
    assert cache.match(hashes, 3) == (7,)
    cache.publish(8, hashes[1])
    assert cache.match(hashes, 3) == (7, 8, 9) and cache.match(hashes, 2) == (7, 8)
    assert cache.publish(3, hashes[1]) is False and cache.publish(8, b"x" * 16) is False
    assert cache.forget(8) == hashes[1] and cache.match(hashes, 3) == (7,)


# ---- sharing and reference counts ----


def test_an_admission_starts_after_its_cached_prefix_and_shares_the_blocks() -> None:
    m = manager()
    admit(m, "a", list(range(10)))  # blocks 0, 1 full and published, block 2 partial
    assert m.prefix.entries() == {BlockHashes(list(range(10)), BS)[i]: i for i in range(2)}
    tokens = list(range(8)) + [50, 51, 52]
    plan = m.plan_step_resources([new("b", tokens)])
    assert plan.hit_blocks == {"b": 2} and plan.new_blocks == 1
    reservation = m.reserve(plan.selected)
    row = reservation.row("b")
    assert (row.cached_blocks, row.new_blocks, row.committed_slots) == ((0, 1), (3,), 8)
    assert reservation.block_table("b") == (0, 1, 3)
    assert m.pool.refcount(0) == 1  # the reservation only pins: references are taken at commit
    reservation.commit()
    assert m.block_table("b") == (0, 1, 3) and m.committed_slots("b") == 11
    assert [m.pool.refcount(b) for b in range(4)] == [2, 2, 1, 1]
    assert validate_cache(m) == []
    stats = m.stats()
    assert (stats.prefix.queries, stats.prefix.hits, stats.prefix.hit_tokens) == (2, 1, 8)
    assert stats.prefix.queried_tokens == 21


def test_the_last_token_is_always_computed() -> None:
    m = manager()
    admit(m, "a", list(range(8)))  # exactly two full blocks, both published
    plan = m.plan_step_resources([new("b", list(range(8)))])
    assert plan.hit_blocks == {"b": 1}  # the second block holds the last token: computed again
    reservation = m.reserve(plan.selected)
    assert reservation.row("b").committed_slots == 4 and reservation.row("b").new_blocks == (2,)
    reservation.commit()
    # The recomputed copy of the second block is not published twice: its digest names block 1 already.
    assert len(m.prefix) == 2 and 2 not in m.prefix
    assert validate_cache(m) == []


def test_released_blocks_stay_cached_until_their_last_reference_goes() -> None:
    m = manager()
    admit(m, "a", list(range(10)))
    admit(m, "b", list(range(8)) + [9])
    assert m.block_table("b") == (0, 1, 3)
    m.deallocate("a")
    assert m.pool.state(0) is BlockState.OWNED and m.pool.refcount(0) == 1  # b still holds it
    assert m.pool.state(2) is BlockState.FREE  # a's partial block had no name
    m.deallocate("b")
    assert m.pool.cached_list() == (1, 0)  # deepest first: the head of a prefix is evicted last
    stats = m.stats()
    assert (stats.free_blocks, stats.cached_blocks, stats.owned_blocks) == (12, 2, 0)
    assert validate_cache(m) == []
    # A later request with the same prefix takes the cached blocks back.
    admit(m, "c", list(range(8)) + [70])
    assert m.block_table("c")[:2] == (0, 1) and m.pool.cached_list() == ()


# ---- LRU eviction ----


def test_eviction_takes_the_least_recently_released_unpinned_blocks() -> None:
    m = manager(num_blocks=6)
    admit(m, "a", list(range(9)))  # 0, 1 named, 2 partial
    admit(m, "b", [40 + i for i in range(9)])  # 3, 4 named, 5 partial
    m.deallocate("a")
    m.deallocate("b")
    assert m.pool.free_list() == (2, 5) and m.pool.cached_list() == (1, 0, 4, 3)
    # c shares a's prefix (pins 0 and 1) and needs 3 new blocks: both free ones, then the oldest unpinned.
    c = list(range(8)) + [90 + i for i in range(9)]
    plan = m.plan_step_resources([new("c", c)])
    assert plan.hit_blocks == {"c": 2} and plan.new_blocks == 3
    reservation = m.reserve(plan.selected)
    assert reservation.row("c").new_blocks == (2, 5, 4)
    assert [block for block, _, _ in reservation.evicted] == [4]
    assert 4 not in m.prefix and m.pool.cached_list() == (1, 0, 3)
    reservation.commit()
    assert m.pool.cached_list() == (3,) and validate_cache(m) == []


def test_planning_counts_cached_blocks_as_free_but_a_claimed_hit_only_once() -> None:
    m = manager(num_blocks=4)
    admit(m, "a", list(range(9)))  # 0, 1 named, 2 partial
    m.deallocate("a")
    assert m.stats().free_blocks == 4
    # Two admissions sharing the cached prefix: the first claims the two CACHED blocks (2 of the supply),
    # the second shares them for nothing; each needs one block of its own.
    plan = m.plan_step_resources([new("b", list(range(8)) + [1]), new("c", list(range(8)) + [2])])
    assert [c.request_id for c in plan.selected] == ["b", "c"] and plan.new_blocks == 2
    # A third would need a fifth block: deferred, for want of blocks.
    plan = m.plan_step_resources(
        [new("b", list(range(8)) + [1]), new("c", list(range(8)) + [2]), new("d", [5] * 5)]
    )
    assert [c.request_id for c in plan.selected] == ["b", "c"] and plan.short_of_blocks == ("d",)


def test_spare_blocks_are_the_supply_the_selection_left_for_drafts() -> None:
    """Free plus evictable cached blocks, less the selection's own blocks and the cached hits it claimed: what
    a resident's speculative drafts may still take. Reserving it all succeeds, evicting only unpinned
    blocks."""
    m = manager(num_blocks=6)
    admit(m, "a", list(range(13)))  # 0, 1, 2 named, 3 partial
    m.deallocate("a")  # 0, 1, 2 CACHED
    admit(m, "r", [50 + i for i in range(5)])  # a resident (2 blocks): 1 FREE block left
    r_hashes = BlockHashes([50 + i for i in range(6)], BS)
    decode = CacheCandidate("r", 6, False, r_hashes)
    b = new("b", list(range(8)) + [1])  # hits 0, 1 and needs one block of its own
    plan = m.plan_step_resources([decode, b])
    assert plan.new_blocks == 1 and plan.spare_blocks == (1 + 3) - 1 - 2  # cached block 2, unclaimed
    drafted = CacheCandidate("r", 6 + 4 * plan.spare_blocks, False, r_hashes)  # drafts up to slot 10
    reservation = m.reserve([drafted, b])
    assert [block for block, _, _ in reservation.evicted] == [2]  # never the pinned 0 and 1
    assert reservation.row("b").cached_blocks == (0, 1) and len(reservation.row("r").new_blocks) == 1
    assert validate_cache(m) == []
    reservation.discard(restore_evicted=True)
    assert sorted(m.pool.cached_list()) == [0, 1, 2] and validate_cache(m) == []


def test_reserve_refuses_what_eviction_cannot_cover_and_changes_nothing() -> None:
    m = manager(num_blocks=3)
    admit(m, "a", list(range(9)))
    m.deallocate("a")
    before = state(m)
    with pytest.raises(CacheError, match="can never fit"):
        m.reserve([new("b", list(range(13)))])
    with pytest.raises(CacheError, match="exceed max_batch_size"):
        m.reserve([new(i, [i]) for i in range(5)])
    assert state(m) == before


# ---- rollback ----


def evicting_reservation():
    m = manager(num_blocks=5)
    admit(m, "a", list(range(9)))  # 0, 1 named, 2 partial
    admit(m, "b", [40 + i for i in range(5)])  # 3 named, 4 partial
    m.deallocate("a")
    m.deallocate("b")
    assert m.pool.cached_list() == (1, 0, 3) and m.pool.free_list() == (2, 4)
    before = state(m)
    plan = m.plan_step_resources([new("c", list(range(4)) + [60 + i for i in range(9)])])
    reservation = m.reserve(plan.selected)  # hit 0, needs 3 new: 2, 4 free, then 1 evicted (0 pinned)
    assert reservation.row("c").cached_blocks == (0,)
    assert reservation.row("c").new_blocks == (2, 4, 1)
    assert validate_cache(m) == []
    return m, reservation, before


def test_discard_before_the_model_ran_restores_everything_exactly() -> None:
    m, reservation, before = evicting_reservation()
    reservation.discard(restore_evicted=True)
    assert state(m) == before and validate_cache(m) == []
    assert m.pool.free_list() == (2, 4)  # every free block was taken, so even the order is back


def test_discard_after_the_model_ran_keeps_evicted_blocks_free_and_the_rest_exact() -> None:
    m, reservation, before = evicting_reservation()
    reservation.discard()
    after = state(m)
    digest = next(d for d, b in before["names"].items() if b == 1)
    assert after["names"] == {d: b for d, b in before["names"].items() if b != 1}
    assert after["lru"] == tuple((b, s) for b, s in before["lru"] if b != 1)
    assert m.pool.free_list() == (2, 4, 1) and m.pool.state(1) is BlockState.FREE
    assert {k: after[k] for k in ("tables", "refs")} == {k: before[k] for k in ("tables", "refs")}
    assert m.prefix.block_of(digest) is None and validate_cache(m) == []


def test_a_committed_hit_survives_a_discarded_step_that_shared_it() -> None:
    m = manager()
    admit(m, "a", list(range(10)))
    before = state(m)
    reservation = m.reserve(m.plan_step_resources([new("b", list(range(8)) + [3])]).selected)
    reservation.discard()
    assert state(m) == before


# ---- the pool's new transitions ----


def test_pool_reference_counts_and_cached_state() -> None:
    pool = BlockPool(4)
    blocks = pool.reserve(3)
    pool.publish(blocks)
    pool.add_ref([0, 1])
    assert pool.refcounts() == (2, 2, 1, 0)
    with pytest.raises(CacheError, match="shared"):
        pool.return_owned([0])
    pool.release([0, 1, 2], keep={0, 1, 2})
    assert pool.refcounts() == (1, 1, 0, 0) and pool.cached_list() == (2,)
    pool.release([0, 1], keep={1})
    assert pool.cached_list() == (2, 1) and pool.free_list() == (3, 0)
    assert pool.num_free + pool.num_cached + pool.num_owned == 4
    pool.add_ref([1])
    assert pool.state(1) is BlockState.OWNED and pool.cached_list() == (2,)
    with pytest.raises(CacheError, match="expected owned or cached"):
        pool.add_ref([3])
    with pytest.raises(CacheError, match="only 0 are evictable"):
        pool.evict(1, pinned={2})
    victims = pool.evict(1)
    assert [b for b, _ in victims] == [2] and pool.state(2) is BlockState.FREE
    pool.restore_cached(victims)
    assert pool.cached_stamps() == victims and pool.free_list() == (3, 0)


# ---- invariants ----


def shared_manager() -> PagedCacheManager:
    m = manager()
    admit(m, "a", list(range(10)))
    admit(m, "b", list(range(8)) + [9])  # shares blocks 0 and 1
    m.deallocate("a")  # block 2 is FREE; nothing cached yet
    admit(m, "c", [30 + i for i in range(5)])  # 4 named (cached when released), 5 partial
    m.deallocate("c")
    return m


CORRUPTIONS = {
    "refcount drift": (
        lambda m: m.pool._refs.__setitem__(0, 3),
        "block 0 (owned) has refcount 3, expected 1",
    ),
    "shared unnamed block": (
        lambda m: m._tables["b"].blocks.append(3),
        "block 3 is owned by both 'b' and 'b'",
    ),
    "named block freed": (lambda m: m.prefix.publish(6, b"z" * 16), "names block 6, which is free"),
    "cached block without a name": (lambda m: m.prefix.forget(4), "block 4 is CACHED but has no name"),
    "named block not full": (lambda m: m.prefix.publish(3, b"y" * 16), "holds named block 3 at index 2"),
    "LRU lists an owned block": (
        lambda m: m.pool._lru.__setitem__(0, 99),
        "0 is in the LRU list but not CACHED",
    ),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_prefix_corruption_is_reported(name: str) -> None:
    corrupt, expected = CORRUPTIONS[name]
    m = shared_manager()
    assert validate_cache(m) == []
    corrupt(m)
    violations = validate_cache(m)
    assert any(expected in v for v in violations), violations


def test_a_block_named_for_other_tokens_is_reported() -> None:
    m = shared_manager()
    tokens = {"b": list(range(8)) + [9]}
    assert validate_prefix_content(m, {rid: BlockHashes(t, BS) for rid, t in tokens.items()}) == []
    wrong = {"b": BlockHashes([1] + list(range(1, 8)) + [9], BS)}
    assert any("named for other tokens" in v for v in validate_prefix_content(m, wrong))


def test_prefix_caching_is_refused_with_a_window_pool() -> None:
    from pagedgen.cache import WindowRingSpec

    with pytest.raises(ValueError, match="purely paged"):
        PagedCacheManager(8, BS, 2, window=WindowRingSpec(4, 4, BS, 8), prefix_caching=True)
