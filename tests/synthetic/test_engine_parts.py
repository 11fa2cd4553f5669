"""The engine's parts: built by one function, handed to ``Engine``, swapped by tests through their keywords.

``pg.Engine(model, config)`` and ``pg.Engine(model, config, parts=build_engine_parts(model, config))`` are the
same engine; parts built for another model or config are refused; a test's own fault injector and spies
reach the step through the parts; ``engine.snapshot()`` covers every field of the request state.
"""

from __future__ import annotations

import dataclasses

import pytest

import pagedgen as pg
from pagedgen.engine.faults import FaultInjector
from pagedgen.engine.parts import EngineParts, build_engine_parts
from pagedgen.engine.request import RequestState
from pagedgen.engine.scheduler import DynamicScheduler
from pagedgen.engine.static import StaticScheduler, StaticStep
from pagedgen.engine.step import DynamicStep
from pagedgen.executor.runner import ModelRunner
from tests.helpers import drain, event_key, record_steps, submit, synthetic_model


def config(**overrides) -> pg.EngineConfig:
    return pg.EngineConfig(**{"block_size": 4, "num_blocks": 32, "debug_invariants": True, **overrides})


def test_the_default_parts_are_the_dynamic_path_over_one_runner():
    model = synthetic_model()
    parts = build_engine_parts(model, config())
    assert isinstance(parts, EngineParts) and parts.model is model and parts.config == config()
    assert isinstance(parts.runner, ModelRunner) and isinstance(parts.step, DynamicStep)
    assert isinstance(parts.scheduler, DynamicScheduler) and parts.scheduler.cache is parts.cache
    assert parts.step.faults is parts.faults and parts.step.isolator is parts.isolator
    assert parts.num_blocks == 32 and parts.cache is not None and parts.cache.num_blocks == 32


def test_the_static_path_has_no_cache_manager():
    parts = build_engine_parts(synthetic_model(), config(dynamic_batching=False))
    assert isinstance(parts.scheduler, StaticScheduler) and isinstance(parts.step, StaticStep)
    assert parts.cache is None and parts.scheduler.cache is None


def test_an_engine_on_given_parts_runs_exactly_like_one_that_built_its_own():
    model = synthetic_model()
    outputs = []
    for parts in (None, build_engine_parts(model, config())):
        engine = pg.Engine(model, config(), parts=parts)
        requests = [submit(engine, [1, 2, 3], 5), submit(engine, list(range(10, 21)), 4)]
        outputs.append([event_key(e) for e in drain(engine)])
        assert [r.status for r in requests] == [pg.RequestStatus.TURN_COMPLETE] * 2
        assert parts is None or engine.parts is parts
    assert outputs[0] == outputs[1] and outputs[0]


@pytest.mark.parametrize("other", ["model", "config", "object"])
def test_parts_built_for_another_model_or_config_are_refused(other):
    model = synthetic_model()
    parts = build_engine_parts(model, config())
    given = {"model": (synthetic_model(), config(), parts), "config": (model, config(num_blocks=16), parts)}
    given["object"] = (model, config(), object())
    with pytest.raises(pg.EngineError, match="build_engine_parts") as raised:
        pg.Engine(*given[other])
    assert isinstance(raised.value, ValueError)


def test_a_test_hands_in_its_own_fault_injector_and_runner_spy():
    faults = FaultInjector()
    steps: list[tuple[list[int], list[int]]] = []
    model = synthetic_model()
    parts = build_engine_parts(model, config(), faults=faults, wrap_runner=record_steps(steps))
    engine = pg.Engine(model, config(), parts=parts)
    request = submit(engine, [5, 6, 7], 2)
    faults.arm("pack")
    (event,) = engine.run(max_events=8)
    assert event.flags == pg.EngineEventFlags.RETRYABLE and steps == []  # rolled back before executing
    drain(engine)
    assert steps == [([3], [0]), ([1], [3])] and request.status is pg.RequestStatus.TURN_COMPLETE


def test_the_scheduler_age_limit_and_the_mask_budget_are_parts_settings():
    parts = build_engine_parts(synthetic_model(), config(), age_limit=3, mask_budget_s=0.5)
    assert isinstance(parts.scheduler, DynamicScheduler) and parts.scheduler.age_limit == 3
    assert parts.step.masker.budget_s == 0.5


def test_the_snapshot_holds_every_field_of_the_request_state():
    """A new field of RequestState is in engine.snapshot() without any change to the tests."""
    engine = pg.Engine(synthetic_model(), config())
    request = submit(engine, [1, 2], 3)
    snap = engine.snapshot()
    fields = {f.name for f in dataclasses.fields(RequestState)} - {"handle_ref"}
    assert set(snap["requests"][request.id]) == fields
    assert snap["requests"][request.id]["tokens"] == (1, 2) and snap["waiting"] == [request.id]
    drain(engine)
    after = engine.snapshot()
    assert after["requests"][request.id]["generated"] == tuple(request.tokens[2:])
    assert after["resident_order"] == [request.id] and after["tables"][request.id][1] == 4
