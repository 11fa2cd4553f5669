"""Bad sampling input is refused where it enters, against the loaded model, by one rule set.

The reported failure: ``set_search_options(logit_bias={99999999: 1.0})`` was accepted, and every later
step rolled back in the sampler. Now the engine API refuses it synchronously with an InvalidArgumentError
(code INVALID_ARGUMENT) naming the field, ``pg.SamplingParams`` and the server use the same rules, and a
refusal changes nothing.
"""

from __future__ import annotations

import pytest

import pagedgen as pg
from pagedgen.errors import SamplingOptionsError
from pagedgen.sampling.options import MAX_LOGIT_BIAS, MAX_STOP_STRINGS
from tests.helpers import drain, engine_snapshot, make_engine, submit, tokens_of

E = pg.EngineErrorCode


@pytest.fixture
def engine() -> pg.Engine:
    return make_engine()


def refused(call, field: str) -> pg.EngineError:
    with pytest.raises(pg.EngineError) as info:
        call()
    error = info.value
    assert error.code is E.INVALID_ARGUMENT and isinstance(error, ValueError)
    assert error.field == field and field in str(error)
    return error


@pytest.mark.parametrize(
    "options, field",
    [
        ({"logit_bias": {99_999_999: 1.0}}, "logit_bias"),
        ({"logit_bias": {257: 1.0}}, "logit_bias"),  # the synthetic vocabulary is 0..256
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"7": 1.0}}, "logit_bias"),
        ({"logit_bias": {1: float("nan")}}, "logit_bias"),
        ({"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": "5"}, "top_k"),
        ({"seed": 1.5}, "seed"),
        ({"min_new_tokens": -2}, "min_new_tokens"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"max_length": 10**9}, "max_length"),
    ],
    ids=lambda v: str(v)[:40],
)
def test_search_options_are_checked_against_the_model_when_set(engine, options, field):
    params = pg.GeneratorParams(engine.model)
    params.set_search_options(temperature=0.5)
    before = (params.max_length, params.sampling)
    refused(lambda: params.set_search_options(**options), field)
    assert (params.max_length, params.sampling) == before  # all-or-nothing


def test_the_largest_token_id_of_the_vocabulary_is_accepted(engine):
    params = pg.GeneratorParams(engine.model)
    params.set_search_options(logit_bias={engine.model.vocab_size - 1: 5.0})
    assert params.sampling.logit_bias == ((engine.model.vocab_size - 1, 5.0),)


@pytest.mark.parametrize(
    "setter, value, field",
    [
        ("set_stop_strings", ["ok", ""], "stop_strings"),
        ("set_stop_strings", "one string", "stop_strings"),
        ("set_stop_strings", ["s"] * (MAX_STOP_STRINGS + 1), "stop_strings"),
        ("set_stop_strings", ["x" * 5000], "stop_strings"),
        ("set_logprobs", 21, "logprobs"),
        ("set_logprobs", True, "logprobs"),
        ("set_max_generated_tokens", -1, "max_generated_tokens"),
    ],
)
def test_turn_options_use_the_same_rules(engine, setter, value, field):
    request = engine.create_request(pg.GeneratorParams(engine.model))
    options = pg.TurnOptions(request)
    refused(lambda: getattr(options, setter)(value), field)
    assert options.spec == pg.TurnOptions(request).spec


def test_a_refused_request_leaves_the_engine_and_its_neighbours_untouched(engine):
    healthy = submit(engine, [1, 2, 3], 6)
    before = engine_snapshot(engine)
    params = pg.GeneratorParams(engine.model)
    refused(lambda: params.set_search_options(logit_bias={99_999_999: 1.0}), "logit_bias")
    assert engine_snapshot(engine) == before
    events = drain(engine)
    assert len(tokens_of(events)[healthy]) == 6 and engine.stats().rollbacks == 0


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": 2.0}, "min_p"),
        ({"top_k": -3}, "top_k"),
        ({"seed": "x"}, "seed"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": ["a"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"logprobs": 21}, "logprobs"),
        ({"logit_bias": {1: 101.0}}, "logit_bias"),
        ({"logit_bias": [(1, 1.0)]}, "logit_bias"),
    ],
    ids=lambda v: str(v)[:30],
)
def test_sampling_params_report_the_shared_rules_under_their_own_names(kwargs, field):
    with pytest.raises(SamplingOptionsError) as info:
        pg.SamplingParams(**kwargs)
    assert info.value.field == field and f"SamplingParams.{field}" in str(info.value)


def test_llm_refuses_an_out_of_vocabulary_bias_before_submitting_anything(engine):
    llm = pg.LLM(engine.model)
    bad = pg.SamplingParams(max_tokens=2, logit_bias={10**6: 1.0})
    good = pg.SamplingParams(max_tokens=2)
    with pytest.raises(pg.EngineError, match="logit_bias") as info:
        llm.generate([[1, 2], [3, 4]], [good, bad])
    assert info.value.code is E.INVALID_ARGUMENT
    stats = llm.engine.stats()
    assert stats.free_blocks == stats.total_blocks and stats.queued_requests == 0
    assert not llm.engine.has_pending_requests()
    (out,) = llm.generate([[1, 2]], good)
    assert len(out.token_ids) == 2
