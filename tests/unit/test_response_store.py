"""The stored-response map: LRU order, the count, byte and age bounds, and releasing kept Requests."""

from __future__ import annotations

import pytest

from pagedgen.server.responses_api.store import ResponseStore, StoredResponse, StoreLimits, json_size


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def record(response_id: str, kept: bool = True, text: str = "x") -> StoredResponse:
    return StoredResponse(
        response_id, {"id": response_id, "text": text}, [{"role": "user", "content": text}], kept
    )


def store_of(**limits) -> tuple[ResponseStore, list[str], Clock]:
    released: list[str] = []
    clock = Clock()
    return ResponseStore(StoreLimits(**limits), released.append, clock), released, clock


def test_the_count_bound_evicts_the_least_recently_used_and_releases_its_request():
    store, released, _ = store_of(max_responses=2)
    assert store.put(record("a")) and store.put(record("b"))
    assert store.get("a") is not None  # b is now the least recently used
    assert store.put(record("c"))
    assert store.get("b") is None and released == ["b"]
    assert {r for r in ("a", "c") if store.get(r) is not None} == {"a", "c"} and len(store) == 2


def test_the_byte_bound_counts_payload_and_conversation():
    one = record("a")
    size = json_size(one.payload) + json_size(one.conversation)
    store, released, _ = store_of(max_bytes=2 * size + 1)
    store.put(record("a"))
    store.put(record("b"))
    assert store.num_bytes == 2 * size
    store.put(record("c"))
    assert store.get("a") is None and released == ["a"] and store.num_bytes == 2 * size


def test_a_response_larger_than_the_byte_bound_is_not_stored_and_its_request_is_released():
    store, released, _ = store_of(max_bytes=10)
    assert not store.put(record("big"))
    assert store.get("big") is None and released == ["big"] and store.num_bytes == 0


def test_responses_older_than_the_age_bound_are_gone():
    store, released, clock = store_of(max_age_s=60)
    store.put(record("old"))
    clock.now += 30
    store.put(record("young", kept=False))
    clock.now += 31
    assert store.get("old") is None and released == ["old"]
    assert store.get("young") is not None
    clock.now += 30
    assert store.get("young") is None and released == ["old"]  # not kept: nothing to release


def test_delete_and_replace():
    store, released, _ = store_of()
    store.put(record("a", text="one"))
    store.put(record("a", text="two"))
    assert store.get("a").payload["text"] == "two" and len(store) == 1 and released == []
    assert store.delete("a") and not store.delete("a")
    assert released == ["a"] and store.num_bytes == 0


def test_zero_responses_stores_nothing():
    store, released, _ = store_of(max_responses=0)
    assert not store.put(record("a")) and released == ["a"] and len(store) == 0


@pytest.mark.parametrize(
    ("limits", "field"),
    [
        ({"max_responses": -1}, "max_responses"),
        ({"max_bytes": -1}, "max_bytes"),
        ({"max_age_s": 0}, "max_age_s"),
    ],
)
def test_bad_limits_are_refused_naming_the_field(limits, field):
    with pytest.raises(ValueError, match=f"StoreLimits.{field}"):
        StoreLimits(**limits)
