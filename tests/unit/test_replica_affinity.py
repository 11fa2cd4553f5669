"""The cache-affinity decision of the replicated server (server/replicas/affinity.py), without Ray."""

from __future__ import annotations

import random

import pytest

from pagedgen.cache.prefix import BlockHashes
from pagedgen.server.replicas.affinity import (
    AffinityTable,
    Route,
    Routing,
    choose,
    power_of_two,
    prompt_digests,
)

BS = 4


def _routing(table, prompt, loads, imbalance=2, affinity=True, seed=0) -> Routing:
    return choose(
        table, prompt, loads, block_size=BS, imbalance=imbalance, affinity=affinity, rng=random.Random(seed)
    )


def _choose(table, prompt, loads, imbalance=2, affinity=True, seed=0) -> list[str]:
    return _routing(table, prompt, loads, imbalance, affinity, seed).order


def test_digests_are_the_prefix_cache_s_block_names():
    prompt = list(range(11))
    assert prompt_digests(prompt, BS) == BlockHashes(prompt, BS).upto(2)  # two full blocks, the rest ignored
    assert prompt_digests(prompt[:3], BS) == []


def test_a_prompt_goes_where_its_longest_prefix_went():
    table = AffinityTable()
    table.record(prompt_digests(list(range(8)), BS), "a")
    table.record(prompt_digests(list(range(4)), BS), "b")  # the first block now names b
    loads = {"a": 0, "b": 0, "c": 0}
    assert table.holder(prompt_digests(list(range(12)), BS), loads) == ("a", 2)
    assert _choose(table, list(range(4)) + [99] * 8, loads)[0] == "b"  # only b holds its first block
    assert _choose(table, list(range(12)), loads)[0] == "a"  # a holds two blocks of it, b one


def test_the_chosen_replica_is_recorded_for_the_whole_prompt_and_the_rest_follow_by_load():
    table = AffinityTable()
    order = _choose(table, list(range(16)), {"a": 3, "b": 1, "c": 2})
    assert order[1:] == sorted((n for n in "abc" if n != order[0]), key={"a": 3, "b": 1, "c": 2}.get)
    assert table.holder(prompt_digests(list(range(16)), BS), {"a": 0, "b": 0, "c": 0}) == (order[0], 4)


@pytest.mark.parametrize(("holder_load", "expected_holder"), [(2, True), (3, False)])
def test_a_holder_more_than_imbalance_busier_is_passed_over(holder_load, expected_holder):
    table = AffinityTable()
    table.record(prompt_digests(list(range(8)), BS), "a")
    loads = {"a": holder_load, "b": 0}
    first = _choose(table, list(range(8)), loads, imbalance=2)[0]
    assert (first == "a") is expected_holder
    if not expected_holder:
        assert first == "b"  # the power of two choices over two replicas picks the idle one


def test_a_dead_or_unknown_holder_is_ignored_and_forgotten():
    table = AffinityTable()
    table.record(prompt_digests(list(range(8)), BS), "gone")
    assert table.holder(prompt_digests(list(range(8)), BS), {"a": 0}) == (None, 0)
    table.forget("gone")
    assert len(table) == 0


def test_the_table_forgets_the_least_recently_routed_first():
    table = AffinityTable(capacity=2)
    table.record(prompt_digests(list(range(8)), BS), "a")
    table.record(prompt_digests([50, 51, 52, 53], BS), "b")
    assert len(table) == 2
    assert table.holder(prompt_digests(list(range(8)), BS), {"a": 0, "b": 0}) == ("a", 2)
    assert table.holder(prompt_digests(list(range(4)), BS), {"a": 0, "b": 0}) == (None, 0)  # evicted


def test_random_routing_ignores_the_prompt_and_records_nothing():
    table = AffinityTable()
    table.record(prompt_digests(list(range(8)), BS), "a")
    firsts = {_choose(table, list(range(8)), {"a": 0, "b": 0}, affinity=False, seed=s)[0] for s in range(20)}
    assert firsts == {"a", "b"} and len(table) == 2


def test_power_of_two_prefers_the_less_loaded_of_two_draws():
    assert power_of_two({"only": 5}, random.Random(0)) == "only"
    picks = {power_of_two({"a": 9, "b": 0, "c": 0}, random.Random(s)) for s in range(30)}
    assert picks == {"b", "c"}  # a loses every draw it is in (ties keep the first drawn)


def test_each_decision_says_how_it_was_made():
    table = AffinityTable()
    loads = {"a": 0, "b": 0}
    first = _routing(table, list(range(8)), loads)
    assert first.route is Route.NEW  # nothing routed yet
    assert _routing(table, list(range(12)), loads) == Routing(first.order, Route.PREFIX)
    assert _routing(table, [1, 2], loads).route is Route.NEW  # not one full block
    busy = {first.order[0]: 3, first.order[1]: 0}
    assert _routing(table, list(range(8)), busy, imbalance=2) == Routing(first.order[::-1], Route.BALANCED)
    assert _routing(table, list(range(8)), loads, affinity=False).route is Route.RANDOM


def test_table_capacity_is_checked():
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        AffinityTable(capacity=0)
