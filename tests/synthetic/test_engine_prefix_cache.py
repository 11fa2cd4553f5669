"""Automatic prefix caching through the public engine API on the synthetic model.

The synthetic model reads the first, previous and current token back *through the block table*, so a request
that starts from another request's cached blocks gets exactly the greedy tokens of a fresh computation only if
those blocks hold exactly its own prefix. Every test compares with caching off (or with the closed formula).
"""

from __future__ import annotations

import pytest

import pagedgen as pg
from pagedgen.engine.faults import FaultInjector
from pagedgen.engine.scheduler import cache_candidates
from pagedgen.errors import ExecutionCapacityError, InjectedFault, RetryableExecutionError
from tests.helpers import (
    after_rollback,
    drain,
    engine_snapshot,
    event_key,
    expected_greedy,
    finishes_of,
    make_engine,
    record_steps,
    spy_evictions,
    submit,
    synthetic_model,
    tokens_of,
)

F = pg.EngineEventFlags
SYSTEM = [
    (11 * j + 5) % 250 + 1 for j in range(21)
]  # a shared "system prompt": 5 full blocks of 4 and 1 more
QUESTIONS = [[100 + i, 7, 8 + i] for i in range(6)]


def run_sequentially(caching: bool, prompts, max_new: int = 6, **config):
    """Each prompt runs to completion before the next is submitted (so later ones can hit the cache)."""
    steps: list = []
    engine = make_engine(block_size=4, prefix_caching=caching, **config, wrap_runner=record_steps(steps))
    outputs, usages = [], []
    for prompt in prompts:
        request = submit(engine, prompt, max_new)
        events = drain(engine)
        outputs.append(tokens_of(events)[request])
        usages.append(finishes_of(events)[request][0].usage)
        request.close()
    return engine, outputs, usages, steps


def test_greedy_tokens_are_identical_with_and_without_caching_and_the_prefix_is_computed_once():
    prompts = [SYSTEM + q for q in QUESTIONS]
    cold, out_off, usage_off, steps_off = run_sequentially(False, prompts)
    warm, out_on, usage_on, steps_on = run_sequentially(True, prompts)
    assert out_on == out_off == [expected_greedy(p, 6) for p in prompts]
    computed_off = sum(sum(q) for q, _ in steps_off)
    computed_on = sum(sum(q) for q, _ in steps_on)
    assert computed_off - computed_on == 5 * len(QUESTIONS[1:]) * 4  # 5 cached blocks per later request
    assert [u.cached_prompt_tokens for u in usage_off] == [0] * 6
    assert [u.cached_prompt_tokens for u in usage_on] == [0] + [20] * 5
    assert all(u.prompt_tokens == 24 for u in usage_on)
    # The first prefill of a hit starts after the cached prefix: past length 20 in the packed inputs.
    assert any(past == [20] for _, past in steps_on)
    stats = warm.stats()
    assert stats.prefix_caching and stats.prefix_caching_off is None
    assert (stats.prefix_queries, stats.prefix_hits, stats.prefix_hit_tokens) == (6, 5, 100)
    assert stats.prefix_queried_tokens == 6 * 24
    assert stats.cached_blocks == stats.prefix_blocks > 0 and stats.free_blocks == stats.total_blocks
    assert not cold.stats().prefix_caching and cold.stats().prefix_hits == 0


def test_concurrent_requests_share_blocks_and_stay_exact():
    """Requests sharing prefixes of different lengths, batched together, some admitted after others commit."""
    engine = make_engine(block_size=4, max_batch_size=8, max_scheduled_tokens=16)
    first = submit(engine, SYSTEM + [1, 2, 3], 10)
    buffer = engine.create_event_buffer(64)
    events = list(engine.run(buffer)) + list(engine.run(buffer))  # part of its prefill is committed
    prompts = {first: SYSTEM + [1, 2, 3]}
    for i, cut in enumerate([4, 8, 12, 21, 21, 3]):
        prompt = SYSTEM[:cut] + [200 + i] * (i + 1)
        prompts[submit(engine, prompt, 8)] = prompt
        events += list(engine.run(buffer))
    events += drain(engine)
    got = tokens_of(events)
    for request, prompt in prompts.items():
        assert got[request] == expected_greedy(prompt, 10 if request is first else 8)
    assert engine.stats().prefix_hits >= 3
    for request in prompts:
        request.close()
    stats = engine.stats()
    assert stats.free_blocks == stats.total_blocks and engine.check_invariants() == []


def test_a_continuation_in_a_new_request_hits_its_history():
    """The server's way: every turn re-sends the whole conversation as a new request."""
    engine = make_engine(block_size=4)
    history = list(SYSTEM[:10])
    for turn in range(3):
        history += [150 + turn, 151]
        request = submit(engine, history, 5)
        events = drain(engine)
        (finish,) = finishes_of(events)[request]
        assert tokens_of(events)[request] == expected_greedy(history, 5)
        if turn:
            assert finish.usage.cached_prompt_tokens >= len(history) - 2 - 4
        history += tokens_of(events)[request]
        request.close()


def test_eviction_under_pressure_keeps_tokens_exact():
    """A pool too small to keep every prefix: cached blocks are evicted, oldest first, when blocks run out."""
    prompts = [[(i * 37 + j * 11) % 250 + 1 for j in range(14)] for i in range(8)]
    prompts += [p[:9] + [240, 241] for p in prompts[:4]]
    engine = make_engine(block_size=4, num_blocks=10, max_batch_size=2)
    outputs = []
    for prompt in prompts:
        request = submit(engine, prompt, 6)
        outputs.append(tokens_of(drain(engine))[request])
        request.close()
        assert engine.check_invariants() == []
    assert outputs == [expected_greedy(p, 6) for p in prompts]
    assert engine.stats().cached_blocks <= 10


def test_models_that_cannot_restore_a_prefix_switch_caching_off():
    windowed = pg.Engine(synthetic_model(window=3), pg.EngineConfig(num_blocks=32))
    assert not windowed.stats().prefix_caching
    assert "sliding-window" in windowed.stats().prefix_caching_off
    hybrid = pg.Engine(synthetic_model(hybrid=True), pg.EngineConfig(num_blocks=32))
    assert "fixed conv" in hybrid.stats().prefix_caching_off
    static = pg.Engine(synthetic_model(), pg.EngineConfig(num_blocks=32, dynamic_batching=False))
    assert "static" in static.stats().prefix_caching_off
    off = pg.Engine(synthetic_model(), pg.EngineConfig(num_blocks=32, prefix_caching=False))
    assert not off.stats().prefix_caching and off.stats().prefix_caching_off is None


def test_prefix_caching_must_be_a_bool():
    with pytest.raises(pg.EngineError, match="prefix_caching must be a bool"):
        pg.EngineConfig(prefix_caching=1)


# ---- rollback of a step that took cached blocks ----


def hit_scenario(evicted: set[int] | None = None, faults: FaultInjector | None = None):
    """A waiting request whose prefix is cached (so the next step takes cached blocks), in a pool so small
    that reserving it must also evict cached blocks, beside a decode and a partial prefill. ``evicted``
    fills with the cached blocks every reservation evicts."""
    wrap = None if evicted is None else spy_evictions(evicted)
    engine = make_engine(block_size=4, num_blocks=14, max_scheduled_tokens=8, wrap_cache=wrap, faults=faults)
    for prompt in ([90 + j for j in range(13)], SYSTEM):
        request = submit(engine, prompt, 2)
        drain(engine)
        request.close()
    requests = {"decode": submit(engine, [3, 4, 5], 8)}
    drain_calls(engine, 2)
    requests["hit"] = submit(engine, SYSTEM[:16] + [60, 61, 62, 63, 64, 65, 66], 4)
    requests["prefill"] = submit(engine, [70 + j for j in range(13)], 3)
    return engine, requests


def drain_calls(engine: pg.Engine, calls: int) -> None:
    for _ in range(calls):
        engine.run(max_events=64)


def reference_events() -> list[tuple]:
    engine, _ = hit_scenario()
    return [event_key(e) for e in drain(engine)]


def test_the_scenario_takes_cached_blocks_and_evicts_others():
    engine, requests = hit_scenario()
    cache = engine.parts.cache
    plan = engine.parts.scheduler.plan()
    hit_row = next(row for row in plan.rows if row.state is requests["hit"]._state)
    assert hit_row.cached_len == 16
    reservation = cache.reserve(cache_candidates(plan.rows))
    assert reservation.pinned_blocks() and reservation.evicted
    reservation.discard(restore_evicted=True)


RECOVERABLE = [
    ("checkpoint", InjectedFault("x"), True),
    ("pack", InjectedFault("x"), True),
    ("execute", RetryableExecutionError("transient"), False),
    ("execute", ExecutionCapacityError("oom"), False),
    ("sample", InjectedFault("x"), False),
    ("stage", InjectedFault("x"), False),
    ("validate", InjectedFault("x"), False),
]


@pytest.mark.parametrize(
    "phase, error, exact", RECOVERABLE, ids=[f"{p}-{type(e).__name__}" for p, e, _ in RECOVERABLE]
)
def test_rollback_of_a_step_that_took_cached_blocks(phase, error, exact):
    evicted: set[int] = set()
    faults = FaultInjector()
    engine, requests = hit_scenario(evicted, faults=faults)
    before = engine_snapshot(engine)
    evicted.clear()  # from here on: the rolled-back step's evictions
    faults.arm(phase, error)
    (event,) = engine.run(max_events=64)
    assert event.request is None and event.flags & (F.RETRYABLE | F.CAPACITY_BLOCKED)
    assert evicted, "the step should have evicted cached blocks"
    after = engine_snapshot(engine)
    if exact:  # the model never ran: even the evicted blocks are back in the cache, in their LRU places
        assert after == before
    else:  # it may have written into the evicted blocks: they come back free and unnamed, nothing else moves
        assert after == after_rollback(before, evicted) != before
    assert engine.check_invariants() == [] and engine.stats().healthy
    events = drain(engine)
    expected = reference_events()
    assert [event_key(e) for e in events] == expected[len(expected) - len(events) :]
    got = tokens_of(events)
    for name, request in requests.items():
        if name != "decode":
            assert got[request] == expected_greedy(
                list(request.tokens[: -len(got[request])]), len(got[request])
            )
    for request in requests.values():
        request.close()
    stats = engine.stats()
    assert stats.free_blocks == stats.total_blocks and engine.check_invariants() == []


@pytest.mark.parametrize("phase", ["plan", "reserve", "prepare", "commit_request", "commit_cache", "publish"])
def test_fatal_failure_of_a_step_that_took_cached_blocks_returns_every_block(phase):
    faults = FaultInjector()
    engine, requests = hit_scenario(faults=faults)
    faults.arm(phase)
    while engine.has_pending_requests():
        engine.run(max_events=64)
    assert not engine.stats().healthy
    for request in requests.values():
        request.close()
    stats = engine.stats()
    assert stats.free_blocks == stats.total_blocks and engine.check_invariants() == []


def test_requests_arriving_together_compute_a_new_shared_prefix_once():
    steps: list = []
    engine = make_engine(block_size=4, max_scheduled_tokens=64, wrap_runner=record_steps(steps))
    prompts = [SYSTEM + q for q in QUESTIONS[:4]] + [[9, 8, 7, 6, 5]]
    requests = [submit(engine, p, 4) for p in prompts]
    events = drain(engine)
    got = tokens_of(events)
    assert [got[r] for r in requests] == [expected_greedy(p, 4) for p in prompts]
    # Step 1 computes the shared prefix once (the leader) beside the unrelated request; the followers wait
    # one step and then start after the 20 cached tokens.
    assert steps[0] == ([24, 5], [0, 0])
    assert sorted(steps[1][1]) == [5, 20, 20, 20, 24]
    assert engine.stats().prefix_hits == 3
    usage = [finishes_of(events)[r][0].usage.cached_prompt_tokens for r in requests]
    assert usage == [0, 20, 20, 20, 0]
