"""Boundaries of the pure paged-slot arithmetic and of sizing a pool from a memory budget."""

from __future__ import annotations

import pytest
import torch

from pagedgen.cache import blocks_for_tokens, num_blocks_for_budget, slot_of_position
from pagedgen.core.kv import KVSpec


@pytest.mark.parametrize(
    ("num_tokens", "block_size", "expected"),
    [
        (0, 4, 0),
        (1, 4, 1),
        (3, 4, 1),
        (4, 4, 1),
        (5, 4, 2),
        (8, 4, 2),
        (9, 4, 3),
        (0, 1, 0),
        (7, 1, 7),
        (16, 16, 1),
        (17, 16, 2),
    ],
)
def test_blocks_for_tokens_boundaries(num_tokens: int, block_size: int, expected: int) -> None:
    assert blocks_for_tokens(num_tokens, block_size) == expected


@pytest.mark.parametrize(("num_tokens", "block_size"), [(-1, 4), (4, 0), (4, -2)])
def test_blocks_for_tokens_rejects_bad_arguments(num_tokens: int, block_size: int) -> None:
    with pytest.raises(ValueError):
        blocks_for_tokens(num_tokens, block_size)


def test_blocks_for_tokens_rejects_float() -> None:
    with pytest.raises(TypeError):
        blocks_for_tokens(2.0, 4)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("position", "expected"),
    [(0, 7 * 4 + 0), (3, 7 * 4 + 3), (4, 2 * 4 + 0), (7, 2 * 4 + 3), (8, 5 * 4 + 0), (11, 5 * 4 + 3)],
)
def test_slot_of_position_crosses_block_boundaries(position: int, expected: int) -> None:
    assert slot_of_position([7, 2, 5], position, 4) == expected


def test_slot_of_position_block_size_one_is_the_table() -> None:
    assert [slot_of_position([9, 0, 4], p, 1) for p in range(3)] == [9, 0, 4]


@pytest.mark.parametrize(
    ("table", "position", "block_size"), [([7, 2], 8, 4), ([], 0, 4), ([7], -1, 4), ([7], 0, 0)]
)
def test_slot_of_position_rejects_out_of_table(table: list[int], position: int, block_size: int) -> None:
    with pytest.raises(ValueError):
        slot_of_position(table, position, block_size)


def test_num_blocks_for_budget_floors() -> None:
    assert num_blocks_for_budget(1000, 100) == 10
    assert num_blocks_for_budget(1099, 100) == 10
    assert num_blocks_for_budget(100, 100) == 1


@pytest.mark.parametrize(("memory", "per_block"), [(99, 100), (0, 100), (-1, 100), (1000, 0), (1000, -5)])
def test_num_blocks_for_budget_rejects_less_than_one_block(memory: int, per_block: int) -> None:
    with pytest.raises(ValueError):
        num_blocks_for_budget(memory, per_block)


def test_num_blocks_for_budget_from_kv_spec() -> None:
    spec = KVSpec(num_layers=2, num_kv_heads=3, head_dim=8, dtype=torch.float16)
    per_block = spec.bytes_per_block(16)
    assert per_block == 2 * 2 * 16 * 3 * 8 * 2  # K and V, layers, slots, heads, head_dim, 2 bytes
    assert num_blocks_for_budget(5 * per_block + per_block - 1, per_block) == 5
