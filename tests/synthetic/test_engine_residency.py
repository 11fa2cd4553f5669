"""Releasing residency (issue 14): idle residents yield, running requests are preempted by recompute, aging.

Nothing waits forever and no output changes: every request's tokens equal the closed formula (or an isolated
run with the same seed), each turn ends exactly once, and no TOKEN event is lost or repeated across a
preemption. Every test runs on the plain synthetic model with prefix caching on and off, and on the windowed
and hybrid models (rings and fixed state are released and rebuilt by a full re-prefill).
"""

from __future__ import annotations

import pytest

import pagedgen as pg
from tests import helpers
from tests.helpers import (
    SyntheticFamily,
    finishes_of,
    record_steps,
    submit,
    tokens_of,
    turn_options,
)

F = pg.EngineEventFlags


@pytest.fixture(
    params=[(None, False, True), (None, False, False), (3, False, False), (None, True, False)],
    ids=["cached", "uncached", "window3", "hybrid"],
)
def variant(request) -> tuple[SyntheticFamily, bool]:
    """The synthetic model the test runs on, and whether prefix caching is on."""
    window, hybrid, caching = request.param
    return SyntheticFamily(window, hybrid), caching


def prompt(i: int, n: int) -> list[int]:
    return [(13 * i + 7 * j + 1) % helpers.VOCAB for j in range(n)]


def run_to_idle(engine: pg.Engine, max_calls: int) -> list[pg.EngineEvent]:
    """The issue's loop: read events until has_pending_requests() is false, with a bound on the calls."""
    buffer = engine.create_event_buffer(64)
    events: list[pg.EngineEvent] = []
    calls = 0
    while engine.has_pending_requests():
        events += engine.run(buffer)
        calls += 1
        assert calls <= max_calls, "the engine spins without finishing"
    return events


def test_64_requests_on_32_slots_all_finish_and_evicted_ones_continue_exactly(variant):
    """The issue's scenario: the first 32 finish their turns and stay open; the rest used to wait forever."""
    family, caching = variant
    recorded: dict[str, list] = {"engine": [], "reference": []}
    engine = family.engine(
        max_batch_size=32,
        block_size=4,
        num_blocks=512,
        prefix_caching=caching,
        wrap_runner=record_steps(recorded["engine"]),
    )
    reference = family.engine(
        max_batch_size=64,
        block_size=4,
        num_blocks=512,
        prefix_caching=caching,
        wrap_runner=record_steps(recorded["reference"]),
    )
    turns = {}
    for eng in (engine, reference):
        requests = [submit(eng, prompt(i, 6 + i % 5), 4) for i in range(64)]
        events = run_to_idle(eng, max_calls=200)
        assert all(not (e.flags & F.CAPACITY_BLOCKED) for e in events)
        finished = finishes_of(events)
        assert all(len(finished[r]) == 1 for r in requests)
        assert all(r.status is pg.RequestStatus.TURN_COMPLETE for r in requests)
        first = tokens_of(events)
        for i, r in enumerate(requests):
            assert first[r] == family.greedy(prompt(i, 6 + i % 5), 4)
        turns[eng] = requests
    stats = engine.stats()
    assert stats.idle_evictions >= 32 and stats.resident_requests == 32
    assert reference.stats().idle_evictions == 0
    # Every request continues (the yielded ones lost residency, not their history): same tokens as the
    # engine that never evicted anything.
    outputs = {}
    for (eng, requests), steps in zip(turns.items(), recorded.values(), strict=True):
        steps.clear()  # from here on: the continuation turns' steps
        for i, r in enumerate(requests):
            r.begin_turn([i % 7 + 1, 2], turn_options(r, 5))
        events = run_to_idle(eng, max_calls=200)
        outputs[eng] = [tokens_of(events)[r] for r in requests]
        for r in requests:
            (finish,) = finishes_of(events)[r]
            assert finish.usage.prompt_tokens == 2 and finish.turn_id == 2
        if eng is engine and caching:  # re-admissions start from the cache: only what it lost is recomputed
            assert engine.stats().prefix_hit_tokens > 0 and any(max(past) > 0 for _, past in steps)
    assert outputs[engine] == outputs[reference]
    for i in range(64):
        history = prompt(i, 6 + i % 5) + family.greedy(prompt(i, 6 + i % 5), 4) + [i % 7 + 1, 2]
        assert outputs[engine][i] == family.greedy(history, 5)
    assert engine.check_invariants() == []


def test_a_tiny_pool_serves_many_requests_to_completion_by_preemption(variant):
    """Six blocks of 4 slots, four rows: each request fits alone (at most 5 blocks), not four at a time."""
    family, caching = variant
    engine = family.engine(max_batch_size=4, block_size=4, num_blocks=6, prefix_caching=caching)
    prompts = [prompt(i, 4 + i % 7) for i in range(16)]
    requests = [submit(engine, p, 8) for p in prompts]
    events = run_to_idle(engine, max_calls=2000)
    got = tokens_of(events)
    finished = finishes_of(events)
    for request, p in zip(requests, prompts, strict=True):
        assert got[request] == family.greedy(p, 8)  # nothing lost, nothing repeated
        assert len(finished[request]) == 1 and finished[request][0].usage.generated_tokens == 8
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.healthy
    for request in requests:
        request.close()
    stats = engine.stats()
    assert stats.free_blocks == stats.total_blocks and engine.check_invariants() == []


@pytest.mark.parametrize("capacity", [1, 3, 64])
def test_preemption_keeps_sampled_streams_stop_strings_and_events_exact(variant, capacity):
    """A sampled request with stop strings and logprobs, preempted and re-prefilled, emits exactly the events
    of an undisturbed run with the same seed."""
    family, caching = variant

    def workload(num_blocks: int):
        engine = family.engine(max_batch_size=3, block_size=4, num_blocks=num_blocks, prefix_caching=caching)
        sampled = submit(
            engine, [6, 7, 8], 14, do_sample=True, temperature=1.3, seed=5, stop_strings=["@@"], logprobs=2
        )
        others = [submit(engine, prompt(i, 5), 10) for i in range(4)]
        buffer = engine.create_event_buffer(capacity)
        events = []
        while engine.has_pending_requests():
            events += engine.run(buffer)
        mine = [
            (e.turn_id, int(e.flags), e.token, e.finish_reason, e.logprobs, e.usage)
            for e in events
            if e.request is sampled
        ]
        return engine, mine, [tokens_of(events)[r] for r in others]

    tiny, events, others = workload(5)
    roomy, expected_events, expected_others = workload(256)
    assert tiny.stats().preemptions > 0 and roomy.stats().preemptions == 0
    assert events == expected_events and others == expected_others


def test_aging_admits_a_large_request_despite_a_stream_of_small_ones(variant):
    family, caching = variant
    engine = family.engine(max_batch_size=4, block_size=4, num_blocks=8, prefix_caching=caching, age_limit=4)
    small = {submit(engine, prompt(i, 3), 6): prompt(i, 3) for i in range(3)}
    big_prompt = prompt(99, 25)
    big = submit(engine, big_prompt, 4)  # 29 tokens: 8 blocks, the whole pool
    buffer = engine.create_event_buffer(64)
    events: list[pg.EngineEvent] = []
    for i in range(200):  # a new small request every other call, forever from the big one's point of view
        if i % 2 == 0:
            small[submit(engine, prompt(i + 3, 3), 6)] = prompt(i + 3, 3)
        events += engine.run(buffer)
        if finishes_of(events)[big]:
            break
    else:
        raise AssertionError("the large request starved")
    assert tokens_of(events)[big] == family.greedy(big_prompt, 4)
    events += run_to_idle(engine, max_calls=2000)
    got = tokens_of(events)
    for request, p in small.items():
        assert got[request] == family.greedy(p, 6) and len(finishes_of(events)[request]) == 1
    assert engine.check_invariants() == []


def test_cancel_and_close_of_a_preempted_request(variant):
    family, caching = variant
    engine = family.engine(max_batch_size=4, block_size=4, num_blocks=6, prefix_caching=caching)
    requests = [submit(engine, prompt(i, 6), 12) for i in range(4)]
    buffer = engine.create_event_buffer(64)
    while engine.stats().preemptions == 0:
        engine.run(buffer)
    preempted = next(r for r in requests if r.status is pg.RequestStatus.ASSIGNED and r.sequence_length > 6)
    assert preempted.processed_length == 0
    assert preempted.cancel_turn(preempted.turn_id) is True
    events = run_to_idle(engine, max_calls=1000)
    (finish,) = finishes_of(events)[preempted]
    assert finish.finish_reason is pg.FinishReason.CANCELLED
    for request in requests:
        request.close()
    stats = engine.stats()
    assert stats.free_blocks == stats.total_blocks and engine.check_invariants() == []
