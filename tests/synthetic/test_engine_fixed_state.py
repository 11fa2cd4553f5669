"""The fixed-state pool through the public API, on the hybrid synthetic model (exact tokens).

The hybrid model's tokens depend on a per-request conv state that every token changes (s0 += (token + 1) *
(position + 1), s1 += 1), so a lost, doubled or misrouted state update, a chunk that does not carry its state
to the next, or an admission that inherits a previous owner's state shows in the tokens. Here: batches equal
the closed formula and each request alone, on the direct (bank views) and the gathered (staging) paths
alike; chunked prefill equals unchunked; turns continue the state; close and abandonment return the slot and
its next owner starts from zeros; and a corrupted slot does change the tokens (the check can fail).
"""

from __future__ import annotations

import gc

import pytest

import pagedgen as pg
from pagedgen.cache import FixedStatePool
from pagedgen.models.synthetic import synthetic_greedy
from tests.helpers import drain, make_engine, record_steps, submit, synthetic_model, tokens_of, turn_options

VOCAB = 257


def hybrid_engine(**config) -> pg.Engine:
    config = {"block_size": 4, "max_batch_size": 4, "max_scheduled_tokens": 10, "chunk_size": 4, **config}
    return make_engine(synthetic_model(hybrid=True), **config)


def expected(prompt, n):
    return synthetic_greedy(list(prompt), n, VOCAB, hybrid=True)


def spy_paths(monkeypatch) -> list[bool]:
    """Record whether each fixed reservation bound the banks directly."""
    paths: list[bool] = []
    reserve = FixedStatePool.reserve

    def spy(self, rows):
        reservation = reserve(self, rows)
        paths.append(reservation.direct)
        return reservation

    monkeypatch.setattr(FixedStatePool, "reserve", spy)
    return paths


PROMPTS = [([1, 2, 3], 12), (list(range(10, 31)), 8), ([7], 15), (list(range(40, 47)), 10)]


def run_batch(**config) -> list[list[int]]:
    engine = hybrid_engine(**config)
    requests = [submit(engine, prompt, n) for prompt, n in PROMPTS]
    out = tokens_of(drain(engine))
    return [out[r] for r in requests]


def test_a_batch_matches_the_formula_on_both_paths(monkeypatch):
    paths = spy_paths(monkeypatch)
    together = run_batch()
    assert together == [expected(p, n) for p, n in PROMPTS]
    assert True in paths and False in paths  # steady decode binds banks; admissions gather
    monkeypatch.setattr(FixedStatePool, "_is_interval", lambda self, ids, slots: False)
    paths.clear()
    assert run_batch() == together and not any(paths)  # every step gathered: the same tokens


def test_every_request_alone_equals_the_batch():
    together = run_batch()
    for (prompt, n), tokens in zip(PROMPTS, together, strict=True):
        engine = hybrid_engine()
        request = submit(engine, prompt, n)
        assert tokens_of(drain(engine))[request] == tokens


def test_chunked_prefill_carries_the_state_from_chunk_to_chunk():
    prompt = list(range(3, 40))
    outputs = []
    for chunk in (1, 3, None):
        steps: list = []
        engine = hybrid_engine(chunk_size=chunk, max_scheduled_tokens=64, wrap_runner=record_steps(steps))
        request = submit(engine, prompt, 10)
        outputs.append(tokens_of(drain(engine))[request])
        assert steps[0][0] == [chunk or len(prompt)]
    assert outputs == [expected(prompt, 10)] * 3


def test_a_second_turn_continues_the_state():
    engine = hybrid_engine()
    request = submit(engine, [5, 6, 7], 4)
    first = tokens_of(drain(engine))[request]
    request.begin_turn([9, 9], turn_options(request, 5))
    second = tokens_of(drain(engine))[request]
    assert second == expected([5, 6, 7, *first, 9, 9], 5)


def test_close_and_abandonment_return_the_slot_and_the_next_owner_starts_from_zeros():
    engine = hybrid_engine(max_batch_size=2)
    kept = submit(engine, [1, 2], 3)
    closed = submit(engine, list(range(20, 30)), 5)
    drain(engine)
    assert engine.stats().fixed_free_slots == 0
    slot = engine.parts.cache.fixed.slot_of(closed.id)
    closed.close()
    assert engine.stats().fixed_free_slots == 1
    fresh = submit(engine, [3, 4, 5], 6)
    assert tokens_of(drain(engine))[fresh] == expected([3, 4, 5], 6)
    assert engine.parts.cache.fixed.slot_of(fresh.id) == slot  # the reused slot, stale banks and all
    del fresh
    gc.collect()
    assert not engine.has_pending_requests()  # reclaims the dropped request
    stats = engine.stats()
    assert stats.fixed_free_slots == 1 and engine.check_invariants() == []
    kept.close()
    assert engine.stats().fixed_free_slots == 2


def test_a_corrupted_slot_changes_the_tokens():
    engine = hybrid_engine()
    request = submit(engine, [1, 2, 3], 2)
    first = tokens_of(drain(engine))[request]
    pool = engine.parts.cache.fixed
    index = pool.slot_of(request.id)
    pool._banks["mix"][pool.slot(index).active, index, 0] += 1  # as if one state update were lost
    request.begin_turn([4], turn_options(request, 3))
    tokens = tokens_of(drain(engine))[request]
    assert tokens != expected([1, 2, 3, *first, 4], 3)


@pytest.mark.parametrize("window", [None, 3])
def test_the_hybrid_formula_differs_from_the_dense_one(window):
    prompt = [3, 1, 4, 1, 5]
    dense = synthetic_greedy(prompt, 8, VOCAB)
    assert expected(prompt, 8) != dense
    engine = make_engine(synthetic_model(hybrid=True, window=window), block_size=4, chunk_size=2)
    request = submit(engine, prompt, 8)
    assert tokens_of(drain(engine))[request] == expected(prompt, 8)
