"""The static path (dynamic_batching=False): a fixed batch run as a unit, same events and finish reasons."""

from __future__ import annotations

import pytest

import pagedgen as pg
from pagedgen.engine.faults import FaultInjector
from tests.helpers import drain, expected_greedy, finishes_of, make_engine, submit, tokens_of, turn_options

F = pg.EngineEventFlags


def static_engine(**config) -> pg.Engine:
    config.setdefault("num_blocks", 16)
    return make_engine(dynamic_batching=False, block_size=4, max_batch_size=4, **config)


def test_a_static_batch_gives_exact_tokens_and_the_same_events():
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10], [11, 12]]
    engine = static_engine()
    requests = [submit(engine, p, 3 + i, max_session_tokens=16) for i, p in enumerate(prompts)]
    assert engine.stats().free_blocks == 16
    events = drain(engine)
    got = tokens_of(events)
    for i, (request, prompt) in enumerate(zip(requests, prompts, strict=True)):
        assert got[request] == expected_greedy(prompt, 3 + i)
        (finish,) = finishes_of(events)[request]
        assert finish.flags == F.TOKEN | F.TURN_FINISHED
        assert finish.finish_reason is pg.FinishReason.MAX_GENERATED_TOKENS
        assert finish.usage == pg.Usage(len(prompt), 3 + i)
    # Rows stay allocated until the batch is recycled.
    assert engine.stats().free_blocks == 0 and engine.stats().resident_requests == 4
    assert engine.check_invariants() == []


def test_static_continuation_while_resident_then_refused_after_recycling():
    engine = static_engine()
    first = submit(engine, [1, 2, 3], 2, max_session_tokens=16)
    g1 = tokens_of(drain(engine))[first]
    first.begin_turn([7, 8], turn_options(first, 3))
    g2 = tokens_of(drain(engine))[first]
    assert g2 == expected_greedy([1, 2, 3, *g1, 7, 8], 3)
    # New work arrives while every row is turn-complete: the batch is recycled, the old row's cache is gone.
    second = submit(engine, [5, 5], 2, max_session_tokens=16)
    assert tokens_of(drain(engine))[second] == expected_greedy([5, 5], 2)
    assert not engine.parts.scheduler.is_resident(first._state)
    before = (first.tokens, first.status)
    with pytest.raises(pg.EngineError, match="recycled"):
        first.begin_turn([9], turn_options(first, 1))
    assert (first.tokens, first.status) == before


def test_closed_static_row_is_skipped_and_released_only_when_the_batch_recycles():
    engine = static_engine()
    a = submit(engine, [1, 2], 5, max_session_tokens=16)
    b = submit(engine, [3, 4], 5, max_session_tokens=16)
    engine.run(max_events=8)
    a.close()
    assert engine.stats().free_blocks == 8 and engine.stats().resident_requests == 2
    events = drain(engine)
    assert {e.request for e in events} == {b}
    assert tokens_of(events)[b] == expected_greedy([3, 4], 5)[1:]
    c = submit(engine, [6], 1, max_session_tokens=16)  # batch all done: recycled for c
    assert tokens_of(drain(engine))[c] == expected_greedy([6], 1)
    assert engine.stats().resident_requests == 1 and engine.stats().free_blocks == 12


def test_static_waiting_requests_run_in_the_next_batch_and_cancel_works():
    engine = static_engine(num_blocks=8)  # two rows of 4 blocks
    requests = [submit(engine, [i + 1], 2, max_session_tokens=16) for i in range(3)]
    engine.run(max_events=8)
    assert requests[2].status is pg.RequestStatus.ASSIGNED
    assert requests[0].cancel_turn(1)
    events = drain(engine)
    assert finishes_of(events)[requests[0]][0].finish_reason is pg.FinishReason.CANCELLED
    assert tokens_of(events)[requests[2]] == expected_greedy([3], 2)


def test_static_unserviceable_and_execution_failures():
    faults = FaultInjector()
    engine = static_engine(num_blocks=4, faults=faults)
    too_big = submit(engine, [1], 2, max_session_tokens=32)  # its row needs 8 blocks of 4
    ok = submit(engine, [2], 2, max_session_tokens=16)
    faults.arm("execute", pg_retryable())
    events = list(engine.run(max_events=8))
    assert [(e.request, e.flags, e.error_code) for e in events] == [
        (too_big, F.TURN_FINISHED | F.FAILED, pg.EngineErrorCode.REQUEST_UNSERVICEABLE),
        (None, F.RETRYABLE, pg.EngineErrorCode.RETRYABLE_EXECUTION),
    ]
    assert tokens_of(drain(engine))[ok] == expected_greedy([2], 2)
    faults.arm("execute")
    ok.begin_turn([3], turn_options(ok, 1))
    events = drain(engine)
    assert [(e.request, e.flags) for e in events] == [(ok, F.TURN_FINISHED | F.FAILED)]
    with pytest.raises(pg.EngineError, match="unhealthy"):
        engine.run(max_events=1)


def pg_retryable():
    from pagedgen.errors import RetryableExecutionError

    return RetryableExecutionError("transient")
