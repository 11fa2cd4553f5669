"""Fault injection at every phase of the step: the documented outcome, and exactly the documented state.

Before the commit boundary a known failure rolls back: one engine-level RETRYABLE or CAPACITY_BLOCKED event,
committed state identical to before the step, the engine healthy, and the retried run produces exactly the
tokens of a run without the fault. Anything unknown, a failed rollback, or a failure at or after the commit
boundary is fail-stop: one TURN_FINISHED|FAILED per affected turn, then every run raises.

Every test runs on four synthetic models: plain, windowed (a sliding-window layer kept in rings of the window
pool, window 3), hybrid (a fixed conv state that every token changes, kept in the fixed-state pool) and both,
so rollback and fail-stop are proven for every pool: after a rollback every fixed slot is byte-identical
(the snapshot holds each owner's visible state), and the retry's tokens, which depend on that state, equal a
fault-free run's.
"""

from __future__ import annotations

import pytest

import pagedgen as pg
from pagedgen.engine.faults import FaultInjector
from pagedgen.engine.outcomes import Phase
from pagedgen.errors import ExecutionCapacityError, InjectedFault, RetryableExecutionError
from tests.helpers import SyntheticFamily, drain, engine_snapshot, event_key, submit

F = pg.EngineEventFlags
E = pg.EngineErrorCode


@pytest.fixture(
    params=[(None, False), (3, False), (None, True), (3, True)],
    ids=["dense", "window3", "hybrid", "hybrid-window3"],
)
def family(request) -> SyntheticFamily:
    """Every test here runs on each synthetic model: dense, windowed, hybrid, both."""
    return SyntheticFamily(*request.param)


def scenario(
    family: SyntheticFamily, faults: FaultInjector | None = None
) -> tuple[pg.Engine, dict[str, pg.Request]]:
    """A decode, a sampled decode with stop strings and logprobs, a partial prefill, a waiting request and an
    idle turn-complete resident: every kind of state a step touches (``faults``: the engine's injector)."""
    engine = family.engine(block_size=4, num_blocks=64, max_scheduled_tokens=10, faults=faults)
    requests = {
        "done": submit(engine, [1, 2], 1),
        "decode": submit(engine, [3, 4, 5], 8),
        "sampled": submit(
            engine, [6, 7], 8, do_sample=True, temperature=1.3, seed=11, stop_strings=["@@"], logprobs=2
        ),
    }
    drain_steps(engine, 2)
    requests["prefill"] = submit(engine, list(range(30, 50)), 3)  # 20 tokens: several chunks
    drain_steps(engine, 1)
    requests["waiting"] = submit(engine, [8, 9], 3)
    assert requests["done"].status is pg.RequestStatus.TURN_COMPLETE
    assert (
        requests["prefill"].status is pg.RequestStatus.ACTIVE
        and 0 < requests["prefill"].processed_length < 20
    )
    return engine, requests


def drain_steps(engine: pg.Engine, steps: int) -> None:
    for _ in range(steps):
        engine.run(max_events=64)
        while engine.stats().pending_events:
            engine.run(max_events=64)


def reference_events(family: SyntheticFamily, capacity: int = 64) -> list[tuple]:
    engine, _ = scenario(family)
    return [event_key(e) for e in drain(engine, capacity)]


RECOVERABLE = [
    ("checkpoint", InjectedFault("x"), F.RETRYABLE, E.RETRYABLE_EXECUTION),
    ("pack", InjectedFault("x"), F.RETRYABLE, E.RETRYABLE_EXECUTION),
    ("execute", RetryableExecutionError("transient"), F.RETRYABLE, E.RETRYABLE_EXECUTION),
    ("execute", ExecutionCapacityError("oom"), F.CAPACITY_BLOCKED, E.EXECUTION_CAPACITY_EXCEEDED),
    ("sample", InjectedFault("x"), F.RETRYABLE, E.RETRYABLE_EXECUTION),
    ("stage", InjectedFault("x"), F.RETRYABLE, E.RETRYABLE_EXECUTION),
    ("validate", InjectedFault("x"), F.RETRYABLE, E.RETRYABLE_EXECUTION),
]


@pytest.mark.parametrize(
    "phase, error, flag, code", RECOVERABLE, ids=[f"{p}-{type(e).__name__}" for p, e, *_ in RECOVERABLE]
)
def test_recoverable_failure_rolls_back_to_identical_state(family, phase, error, flag, code):
    faults = FaultInjector()
    engine, requests = scenario(family, faults=faults)
    before = engine_snapshot(engine)
    faults.arm(phase, error)
    events = list(engine.run(max_events=64))
    assert [(e.request, e.flags, e.error_code) for e in events] == [(None, flag, code)]
    assert engine_snapshot(engine) == before
    stats = engine.stats()
    assert stats.healthy and stats.rollbacks == 1 and engine.check_invariants() == []
    # The retry sees the same turn boundaries and produces exactly the fault-free output.
    events = drain(engine)
    expected = reference_events(family)
    assert [event_key(e) for e in events] == expected[len(expected) - len(events) :]
    assert_all_blocks_return(family, engine, requests)


def test_retried_rollbacks_keep_sampled_streams_exact(family):
    faults = FaultInjector()
    engine, requests = scenario(family, faults=faults)
    for phase in ("stage", "validate", "stage"):
        faults.arm(phase)
        (event,) = engine.run(max_events=64)
        assert event.flags == F.RETRYABLE
        engine.run(max_events=64)  # a successful step in between
    events = drain(engine)
    reference, _ = scenario(family)
    drain_steps(reference, 3)
    assert [event_key(e) for e in events] == [event_key(e) for e in drain(reference)]
    assert engine.stats().rollbacks == 3


FATAL = [
    ("plan", InjectedFault("x"), E.ENGINE_CONTRACT_FAILURE),
    ("reserve", InjectedFault("x"), E.ENGINE_CONTRACT_FAILURE),
    ("execute", InjectedFault("unknown"), E.ENGINE_EXECUTION_FAILURE),
    ("execute", ValueError("model bug"), E.ENGINE_EXECUTION_FAILURE),
    ("prepare", InjectedFault("x"), E.ENGINE_EXECUTION_FAILURE),
    ("commit_request", InjectedFault("x"), E.ENGINE_EXECUTION_FAILURE),
    ("commit_cache", InjectedFault("x"), E.ENGINE_EXECUTION_FAILURE),
    ("publish", InjectedFault("x"), E.ENGINE_EXECUTION_FAILURE),
]


@pytest.mark.parametrize("phase, error, code", FATAL, ids=[f"{p}-{type(e).__name__}" for p, e, _ in FATAL])
def test_fatal_failure_fails_every_affected_turn_then_run_raises(family, phase, error, code):
    faults = FaultInjector()
    engine, requests = scenario(family, faults=faults)
    affected = {name for name, r in requests.items() if r.status.executable}
    assert affected == {"decode", "sampled", "prefill", "waiting"}
    faults.arm(phase, error)
    events = drain_fatal(engine)
    assert_failed_turns(events, requests, affected, code)
    assert not engine.stats().healthy and not engine.has_pending_requests()
    with pytest.raises(pg.EngineError, match="unhealthy") as raised:
        engine.run(max_events=4)
    assert raised.value.cause is error
    with pytest.raises(pg.EngineError, match="unhealthy"):
        engine.run(max_events=0)
    with pytest.raises(pg.EngineError, match="unhealthy"):
        requests["done"].begin_turn([1])
    assert requests["decode"].cancel_turn(1) is False
    assert_all_blocks_return(family, engine, requests)


def test_failed_rollback_is_fatal(family):
    faults = FaultInjector()
    engine, requests = scenario(family, faults=faults)
    faults.arm("execute", RetryableExecutionError("transient"))
    faults.arm("rollback")
    events = drain_fatal(engine)
    assert_failed_turns(
        events, requests, {"decode", "sampled", "prefill", "waiting"}, E.ENGINE_EXECUTION_FAILURE
    )
    assert_all_blocks_return(family, engine, requests)


def test_fatal_failure_with_no_affected_turn_emits_one_engine_event(family):
    faults = FaultInjector()
    engine = family.engine(faults=faults)
    request = submit(engine, [1, 2], 1)
    drain(engine)
    faults.arm("plan")
    events = list(engine.run(max_events=4))
    assert [(e.request, e.flags, e.error_code) for e in events] == [
        (None, F.FAILED, E.ENGINE_CONTRACT_FAILURE)
    ]
    with pytest.raises(pg.EngineError, match="unhealthy"):
        engine.run(max_events=4)
    request.close()
    assert engine.stats().free_blocks == engine.stats().total_blocks


def test_capacity_one_drains_failure_events_before_raising(family):
    faults = FaultInjector()
    engine, requests = scenario(family, faults=faults)
    faults.arm("execute")
    events = []
    while True:
        try:
            batch = list(engine.run(max_events=1))
        except pg.EngineError:
            break
        assert len(batch) == 1
        events += batch
    assert_failed_turns(
        events, requests, {"decode", "sampled", "prefill", "waiting"}, E.ENGINE_EXECUTION_FAILURE
    )


def test_planning_memory_error_propagates_and_leaves_the_engine_healthy(family):
    faults = FaultInjector()
    engine, _ = scenario(family, faults=faults)
    before = engine_snapshot(engine)
    faults.arm("plan", MemoryError("planning scratch"))
    with pytest.raises(MemoryError):
        engine.run(max_events=4)
    assert engine_snapshot(engine) == before and engine.stats().healthy
    expected = reference_events(family)
    assert [event_key(e) for e in drain(engine)] == expected


def test_interrupt_rolls_back_and_propagates(family):
    faults = FaultInjector()
    engine, _ = scenario(family, faults=faults)
    before = engine_snapshot(engine)
    faults.arm("sample", KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        engine.run(max_events=4)
    assert engine_snapshot(engine) == before and engine.stats().healthy


def test_unknown_fault_phase_is_refused(family):
    faults = FaultInjector()
    family.engine(faults=faults)
    with pytest.raises(pg.EngineError, match="unknown fault phase"):
        faults.arm("explode")
    assert set(Phase) >= {Phase.PLAN, Phase.PUBLISH}


def drain_fatal(engine: pg.Engine) -> list[pg.EngineEvent]:
    events: list[pg.EngineEvent] = []
    while engine.has_pending_requests():
        events += engine.run(max_events=3)
    return events


def assert_failed_turns(events, requests, affected: set[str], code) -> None:
    names = {id(r): name for name, r in requests.items()}
    finished = [e for e in events if e.flags & F.TURN_FINISHED]
    assert sorted(names[id(e.request)] for e in finished) == sorted(affected)
    for event in finished:
        assert event.flags & F.FAILED and event.finish_reason is pg.FinishReason.FAILED
        assert event.error_code is code and event.turn_id == event.request.turn_id
        assert event.usage is not None
    assert all(e.flags & F.TURN_FINISHED for e in events if e.request is not None and e.flags & F.FAILED)
    for name in affected:
        assert requests[name].status is pg.RequestStatus.TURN_COMPLETE


def assert_all_blocks_return(
    family: SyntheticFamily, engine: pg.Engine, requests: dict[str, pg.Request]
) -> None:
    for request in requests.values():
        request.close()
    stats = engine.stats()
    assert stats.free_blocks == stats.total_blocks and stats.resident_requests == 0
    assert stats.window_free_blocks == stats.window_total_blocks
    assert (stats.window_total_blocks > 0) == (family.window is not None)
    assert stats.fixed_free_slots == stats.fixed_total_slots
    assert (stats.fixed_total_slots > 0) == family.hybrid
    assert engine.check_invariants() == []
