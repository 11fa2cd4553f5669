"""Every refused call raises an EngineError naming the problem and changes nothing."""

from __future__ import annotations

import threading

import pytest

import pagedgen as pg
from tests.helpers import engine_snapshot, make_engine, submit, turn_options


def assert_refused(engine: pg.Engine, call, error=pg.EngineError, match: str | None = None) -> None:
    before = engine_snapshot(engine)
    with pytest.raises(error, match=match):
        call()
    assert engine_snapshot(engine) == before
    assert engine.check_invariants() == []


@pytest.fixture
def engine():
    return make_engine(block_size=4)


def test_begin_turn_refuses_bad_tokens(engine):
    request = engine.create_request(pg.GeneratorParams(engine.model))
    for bad in ([], [1, -1], [1, 257], [1.5], "abc", [[1, 2]], None):
        assert_refused(engine, lambda bad=bad: request.begin_turn(bad), pg.EngineError)
    assert request.status is pg.RequestStatus.UNASSIGNED and request.turn_id == 0


def test_begin_turn_refused_while_queued_active_or_with_undrained_events(engine):
    other = submit(engine, [9], 10)  # first in resident order: its event comes first in every step
    request = submit(engine, [1, 2, 3], 3)
    assert_refused(engine, lambda: request.begin_turn([4]), match="still assigned")
    engine.run(max_events=8)
    assert request.status is pg.RequestStatus.ACTIVE
    assert_refused(engine, lambda: request.begin_turn([4]), match="still active")
    while request.status is not pg.RequestStatus.TURN_COMPLETE:
        engine.run(max_events=1)
    assert engine.stats().pending_events == 1  # the request's terminal event is retained
    assert_refused(engine, lambda: request.begin_turn([4]), match="undrained")
    engine.run(max_events=1)
    assert request.begin_turn([4], turn_options(request, 1)) == 2
    assert other.status is pg.RequestStatus.ACTIVE


def test_calls_after_close_are_refused(engine):
    request = submit(engine, [1, 2], 2)
    request.close()
    assert_refused(engine, lambda: request.begin_turn([1]), pg.EngineError, match="closed")
    assert_refused(engine, lambda: request.cancel_turn(1), pg.EngineError, match="closed")
    assert_refused(engine, lambda: request.set_draft_tokens([]), pg.EngineError, match="closed")


def test_cancel_before_the_first_turn_is_an_error(engine):
    request = engine.create_request(pg.GeneratorParams(engine.model))
    assert_refused(engine, lambda: request.cancel_turn(1), match="never called")


def test_calls_from_another_thread_are_refused(engine):
    request = submit(engine, [1, 2], 2)
    buffer = engine.create_event_buffer(4)
    params = pg.GeneratorParams(engine.model)
    calls = {
        "begin_turn": lambda: request.begin_turn([3]),
        "cancel_turn": lambda: request.cancel_turn(1),
        "close": request.close,
        "set_draft_tokens": lambda: request.set_draft_tokens([]),
        "run": lambda: engine.run(buffer),
        "has_pending_requests": engine.has_pending_requests,
        "create_request": lambda: engine.create_request(params),
        "create_event_buffer": lambda: engine.create_event_buffer(2),
        "stats": engine.stats,
        "engine.close": engine.close,
    }
    errors: dict[str, BaseException | None] = {}
    before = engine_snapshot(engine)

    def worker():
        for name, call in calls.items():
            try:
                call()
                errors[name] = None
            except BaseException as exc:  # noqa: BLE001 - recorded and asserted on the test thread
                errors[name] = exc

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    for name in calls:
        assert isinstance(errors[name], pg.EngineError), name
        assert "owner thread" in str(errors[name])
    assert engine_snapshot(engine) == before
    assert request.status is pg.RequestStatus.ASSIGNED


def test_session_limit_and_foreign_options_are_refused(engine):
    options = pg.RequestOptions()
    options.set_max_session_tokens(5)
    request = engine.create_request(pg.GeneratorParams(engine.model), options)
    assert_refused(engine, lambda: request.begin_turn([1, 2, 3, 4, 5]), match="max_session_tokens")
    other = engine.create_request(pg.GeneratorParams(engine.model))
    assert_refused(engine, lambda: request.begin_turn([1], pg.TurnOptions(other)), match="different request")
    assert_refused(engine, lambda: request.begin_turn([1], "not options"), match="TurnOptions")
    assert request.begin_turn([1, 2, 3, 4], pg.TurnOptions()) == 1  # unbound options are fine


def test_run_refuses_foreign_or_ambiguous_buffers(engine):
    submit_kept = submit(engine, [1], 1)
    foreign = make_engine().create_event_buffer(4)
    assert_refused(engine, lambda: engine.run(foreign), match="not created by this engine")
    assert_refused(engine, lambda: engine.run(engine.create_event_buffer(2), max_events=2), match="not both")
    assert_refused(engine, lambda: engine.run(), match="max_events")
    assert_refused(engine, lambda: engine.create_event_buffer(-1), match="capacity")
    assert submit_kept.status is pg.RequestStatus.ASSIGNED


def test_generator_params_and_options_validate_all_or_nothing():
    model = pg.SyntheticModel()
    params = pg.GeneratorParams(model)
    with pytest.raises(pg.EngineError, match="unknown search option"):
        params.set_search_options(temperature=0.5, beam_width=2)
    with pytest.raises(pg.EngineError, match="top_p"):
        params.set_search_options(temperature=0.5, top_p=0.0)
    with pytest.raises(pg.EngineError, match="max_length"):
        params.set_search_options(max_length=model.max_context + 1)
    assert params.sampling == pg.GeneratorParams(model).sampling and params.max_length == model.max_context
    params.set_search_options(do_sample=True, temperature=0.7, top_k=5, seed=3, max_length=100)
    assert (params.sampling.temperature, params.sampling.top_k, params.max_length) == (0.7, 5, 100)
    for bad in (-1, 1.5, True):
        with pytest.raises(pg.EngineError):
            pg.RequestOptions().set_max_session_tokens(bad)
        with pytest.raises(pg.EngineError):
            pg.TurnOptions().set_max_generated_tokens(bad)
    with pytest.raises(pg.EngineError):
        pg.TurnOptions().set_logprobs(21)
    with pytest.raises(pg.EngineError):
        pg.TurnOptions().set_stop_strings("\n")


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_batch_size", 0),
        ("max_scheduled_tokens", -1),
        ("block_size", 1.5),
        ("num_blocks", 0),
        ("kv_cache_memory_bytes", True),
        ("chunk_size", 0),
        ("max_mixed_step_tokens", 0),
        ("dynamic_batching", 1),
    ],
)
def test_engine_config_names_the_bad_field(field, value):
    with pytest.raises(pg.EngineError, match=f"EngineConfig.{field}"):
        pg.EngineConfig(**{field: value})


def test_engine_rejects_foreign_params():
    engine = make_engine()
    with pytest.raises(pg.EngineError, match="this engine's model"):
        engine.create_request(pg.GeneratorParams(pg.SyntheticModel()))
