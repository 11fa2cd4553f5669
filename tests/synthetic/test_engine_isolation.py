"""Failure isolation: one request's failure never stalls or changes the others.

A failure attributed to one request (its sampling row, its stop matcher) fails that turn alone with
REQUEST_FAILED; an unattributed failure that keeps recurring is narrowed down by halving the batch until the
request that causes it is found; a fault that clears is retried and loses nothing. In every case the other
requests produce exactly the tokens they produce alone, the engine stays healthy, and every block returns.
"""

from __future__ import annotations

import pytest

import pagedgen as pg
from pagedgen.engine.faults import FaultInjector
from pagedgen.errors import ExecutionCapacityError, InjectedFault, RetryableExecutionError
from pagedgen.sampling import SamplingOptions
from tests.helpers import drain, finishes_of, make_engine, submit, tokens_of

F = pg.EngineEventFlags
E = pg.EngineErrorCode

# name -> (prompt, new tokens, search options): greedy, seeded sampling with stop strings and logprobs,
# and a long prompt that is still prefilling in chunks when the faults start.
REQUESTS = {
    "a": ([3, 4, 5], 10, {}),
    "b": ([6, 7], 10, {"do_sample": True, "temperature": 1.3, "seed": 11}),
    "c": (list(range(30, 50)), 6, {}),
    "d": ([8, 9, 10, 11], 10, {"do_sample": True, "top_k": 5, "seed": 2}),
}


def start(names=tuple(REQUESTS), **config) -> tuple[pg.Engine, dict[str, pg.Request]]:
    config.setdefault("block_size", 4)
    config.setdefault("num_blocks", 64)
    config.setdefault("max_scheduled_tokens", 12)
    engine = make_engine(**config)
    requests = {}
    for name in names:
        prompt, new, search = REQUESTS[name]
        requests[name] = submit(
            engine, prompt, new, max_session_tokens=48, stop_strings=["@@"], logprobs=2, **search
        )
    return engine, requests


def alone(name: str) -> list[int]:
    """The tokens a request produces when it is the only one on its engine."""
    engine, requests = start([name])
    return tokens_of(drain(engine))[requests[name]]


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    return {name: alone(name) for name in REQUESTS}


def check_outcome(engine, requests, events, reference, failed: set[str], static: bool = False) -> None:
    """``failed`` turns ended REQUEST_FAILED; every other request got exactly its alone tokens.

    Then every request is closed and every block must be free (the static path frees a batch's blocks when
    it recycles the batch, so there all rows must merely be closed).
    """
    tokens, finishes = tokens_of(events), finishes_of(events)
    for name, request in requests.items():
        (finish,) = finishes[request]
        if name in failed:
            assert finish.flags & F.FAILED and finish.error_code is E.REQUEST_FAILED
            assert finish.finish_reason is pg.FinishReason.FAILED
            assert tokens[request] == reference[name][: len(tokens[request])]
            assert finish.usage.generated_tokens >= len(tokens[request])  # held stop-string tokens count
        else:
            assert not finish.flags & F.FAILED, name
            assert tokens[request] == reference[name], name
    stats = engine.stats()
    assert stats.healthy and engine.check_invariants() == []
    for request in requests.values():
        request.close()
    stats = engine.stats()
    if static:
        assert not engine.has_pending_requests() and not engine.snapshot()["requests"]
    else:
        assert stats.free_blocks == stats.total_blocks and stats.resident_requests == 0


def run_some(engine: pg.Engine, steps: int) -> list[pg.EngineEvent]:
    events = []
    for _ in range(steps):
        events += engine.run(max_events=64)
    return events


@pytest.mark.parametrize("phase", ["sample", "stage"])
def test_a_fault_attributed_to_one_request_fails_only_its_turn(reference, phase):
    faults = FaultInjector()
    engine, requests = start(faults=faults)
    events = run_some(engine, 3)  # "c" is mid-prefill, the others decode
    faults.arm(phase, times=None, request_id=requests["b"].id, attributed=True)
    before = engine.stats()
    step = list(engine.run(max_events=64))
    # The step rolled back and published only the failed turn; nothing else moved.
    assert [(e.request, e.flags, e.error_code) for e in step] == [
        (requests["b"], F.TURN_FINISHED | F.FAILED, E.REQUEST_FAILED)
    ]
    after = engine.stats()
    assert (after.steps, after.rollbacks) == (before.steps, before.rollbacks + 1)
    assert requests["b"].status is pg.RequestStatus.TURN_COMPLETE
    events += step + drain(engine)
    check_outcome(engine, requests, events, reference, failed={"b"})


def test_a_row_the_sampler_refuses_fails_only_its_request(reference):
    """The reported denial of service: a logit bias outside the vocabulary used to roll back every step.

    set_search_options now refuses it; here it is forced past validation to prove the step's last line of
    defence: the sampler names the row, and only that request fails.
    """
    engine, requests = start()
    state = requests["d"]._state
    bad = SamplingOptions(do_sample=True, top_k=5, seed=2, logit_bias=((99_999_999, 1.0),))
    state.sampler.options = bad
    events = drain(engine)
    check_outcome(engine, requests, events, reference, failed={"d"})
    assert engine.stats().rollbacks == 1


@pytest.mark.parametrize(
    "error",
    [RetryableExecutionError("recurs with d"), ExecutionCapacityError("d needs too much memory")],
    ids=["retryable", "capacity"],
)
def test_an_unattributed_fault_that_recurs_with_one_request_is_isolated(reference, error):
    faults = FaultInjector()
    engine, requests = start(max_step_retries=3, faults=faults)
    events = run_some(engine, 2)
    faults.arm("execute", error, times=None, request_id=requests["d"].id)
    events += drain(engine)
    check_outcome(engine, requests, events, reference, failed={"d"})
    # Bounded: 3 tries of the whole batch, then halves of it, never more than retries * (2 * batch - 1).
    assert 3 <= engine.stats().rollbacks <= 3 * (2 * len(requests) - 1)


def test_a_fault_that_always_recurs_fails_every_turn_without_spinning():
    faults = FaultInjector()
    engine, requests = start(max_step_retries=2, faults=faults)
    faults.arm("execute", RetryableExecutionError("always"), times=None)
    events = drain(engine, max_calls=1000)
    finishes = finishes_of(events)
    for request in requests.values():
        (finish,) = finishes[request]
        assert finish.error_code is E.REQUEST_FAILED and not tokens_of(events)[request]
    assert engine.stats().healthy and engine.stats().steps == 0
    assert engine.stats().rollbacks <= 2 * (2 * len(requests) - 1)
    for request in requests.values():
        request.close()
    assert engine.stats().free_blocks == engine.stats().total_blocks


@pytest.mark.parametrize("phase", ["pack", "execute", "sample", "stage", "validate"])
def test_a_fault_that_clears_within_the_retries_loses_nothing(reference, phase):
    faults = FaultInjector()
    engine, requests = start(max_step_retries=3, faults=faults)
    events = run_some(engine, 2)
    error = RetryableExecutionError("twice") if phase == "execute" else InjectedFault("twice")
    faults.arm(phase, error, times=2)
    events += drain(engine)
    check_outcome(engine, requests, events, reference, failed=set())
    assert engine.stats().rollbacks == 2


def test_requests_that_arrive_during_isolation_run_afterwards(reference):
    faults = FaultInjector()
    engine, requests = start(["a", "b"], max_step_retries=1, faults=faults)
    faults.arm("execute", RetryableExecutionError("with b"), times=None, request_id=requests["b"].id)
    events = run_some(engine, 1)
    prompt, new, search = REQUESTS["c"]
    requests["c"] = submit(
        engine, prompt, new, max_session_tokens=48, stop_strings=["@@"], logprobs=2, **search
    )
    events += drain(engine)
    check_outcome(engine, requests, events, reference, failed={"b"})


def test_an_isolated_request_can_begin_another_turn():
    faults = FaultInjector()
    engine, requests = start(["a"], max_step_retries=1, faults=faults)
    faults.arm("execute", RetryableExecutionError("once more"), times=1, request_id=requests["a"].id)
    events = drain(engine)
    (finish,) = finishes_of(events)[requests["a"]]
    assert finish.error_code is E.REQUEST_FAILED
    options = pg.TurnOptions(requests["a"])
    options.set_max_generated_tokens(3)
    assert requests["a"].begin_turn([7], options) == 2
    more = drain(engine)
    assert len(tokens_of(more)[requests["a"]]) == 3 and engine.check_invariants() == []


def test_attributed_faults_need_a_request():
    faults = FaultInjector()
    make_engine(faults=faults)
    with pytest.raises(pg.EngineError, match="request_id"):
        faults.arm("sample", attributed=True)
    with pytest.raises(pg.EngineError, match="times"):
        faults.arm("sample", times=0)


def test_the_static_path_isolates_too(reference):
    faults = FaultInjector()
    engine, requests = start(dynamic_batching=False, max_step_retries=2, faults=faults)
    faults.arm("execute", RetryableExecutionError("with c"), times=None, request_id=requests["c"].id)
    state = requests["a"]._state
    state.sampler.options = SamplingOptions(logit_bias=((10**8, 1.0),))  # forced past validation
    events = drain(engine, max_calls=1000)
    check_outcome(engine, requests, events, reference, failed={"a", "c"}, static=True)
