"""The block pool's legal transitions, all-or-nothing refusals and generation counter."""

from __future__ import annotations

import pytest

from pagedgen.cache import BlockPool, BlockState
from pagedgen.errors import CacheError


def test_fresh_pool_hands_out_ids_in_order() -> None:
    pool = BlockPool(5)
    assert pool.free_list() == (0, 1, 2, 3, 4)
    assert pool.reserve(2) == (0, 1)
    assert pool.reserve(1) == (2,)
    assert (pool.num_free, pool.num_reserved, pool.num_owned) == (2, 3, 0)
    assert pool.states()[:3] == (BlockState.RESERVED,) * 3


def test_returned_blocks_go_to_the_back_of_the_free_list() -> None:
    pool = BlockPool(4)
    blocks = pool.reserve(3)
    pool.publish(blocks)
    pool.return_owned([1, 0])
    assert pool.free_list() == (3, 1, 0)
    assert pool.reserve(2) == (3, 1)


def test_full_cycle_and_generation_advances_on_every_mutation() -> None:
    pool = BlockPool(3)
    generations = [pool.generation]
    blocks = pool.reserve(2)
    generations.append(pool.generation)
    pool.publish(blocks[:1])
    generations.append(pool.generation)
    pool.return_reserved(blocks[1:])
    generations.append(pool.generation)
    pool.return_owned(blocks[:1])
    generations.append(pool.generation)
    pool.record_mutation()
    generations.append(pool.generation)
    assert generations == sorted(set(generations))
    assert pool.state(0) is BlockState.FREE and pool.num_free == 3


def test_reserve_beyond_free_is_refused_without_change() -> None:
    pool = BlockPool(3)
    pool.reserve(2)
    generation, free = pool.generation, pool.free_list()
    with pytest.raises(CacheError, match="only 1 of 3 free"):
        pool.reserve(2)
    assert (pool.generation, pool.free_list()) == (generation, free)


@pytest.mark.parametrize(
    ("action", "blocks"),
    [
        ("publish", [0, 2]),
        ("publish", [0, 0]),
        ("publish", [9]),
        ("return_owned", [0]),
        ("return_reserved", [1, 1]),
    ],
)
def test_illegal_transitions_change_nothing(action: str, blocks: list[int]) -> None:
    pool = BlockPool(3)
    pool.reserve(2)  # 0, 1 reserved; 2 free
    before = (pool.generation, pool.states(), pool.free_list(), pool.num_reserved)
    with pytest.raises(CacheError):
        getattr(pool, action)(blocks)
    assert (pool.generation, pool.states(), pool.free_list(), pool.num_reserved) == before


@pytest.mark.parametrize("num_blocks", [0, -1])
def test_pool_size_must_be_positive(num_blocks: int) -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks)
