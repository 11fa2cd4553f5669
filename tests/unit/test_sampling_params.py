"""``SamplingParams`` is the one definition of a request's sampling fields: the server's request bodies take
their defaults and types from it and pass them on by name, so the two cannot drift apart unnoticed."""

from __future__ import annotations

import dataclasses
import typing

import pytest

import pagedgen as pg
import pagedgen.llm
from pagedgen.sampling.params import SamplingParams, StructuredOutputsParams
from pagedgen.server.protocol import WIRE_SHAPED, ChatCompletionRequest, CompletionRequest

FIELDS = {f.name: f for f in dataclasses.fields(SamplingParams)}
SAME_SHAPE = sorted(set(FIELDS) - WIRE_SHAPED)
BODIES = (ChatCompletionRequest, CompletionRequest)
# A value unlike the default for every field a body passes on as it is.
NON_DEFAULT = {
    "temperature": 0.5,
    "top_p": 0.75,
    "min_p": 0.25,
    "seed": 7,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "repetition_penalty": 1.25,
    "ignore_eos": True,
    "min_tokens": 3,
}


def test_the_public_names_are_the_sampling_layers_types():
    assert pg.SamplingParams is pagedgen.llm.SamplingParams is SamplingParams
    assert pg.StructuredOutputsParams is pagedgen.llm.StructuredOutputsParams is StructuredOutputsParams


def test_the_wire_shaped_names_are_fields_of_sampling_params():
    assert set(FIELDS) >= WIRE_SHAPED


@pytest.mark.parametrize("body", BODIES, ids=lambda body: body.__name__)
@pytest.mark.parametrize("name", SAME_SHAPE)
def test_a_body_field_has_the_type_and_default_of_sampling_params(body, name):
    hints = typing.get_type_hints(SamplingParams)
    assert body.model_fields[name].annotation == hints[name]
    assert body.model_fields[name].default == FIELDS[name].default


def test_every_field_passed_on_as_it_is_has_a_non_default_case():
    assert sorted(NON_DEFAULT) == SAME_SHAPE


@pytest.mark.parametrize("body", BODIES, ids=lambda body: body.__name__)
def test_a_body_passes_every_same_shape_field_on(body):
    wire = {"model": "m", **NON_DEFAULT}
    wire.update({"messages": [{"role": "user", "content": "hi"}]} if body is ChatCompletionRequest else {})
    wire.update({"prompt": "hi"} if body is CompletionRequest else {})
    params = body.model_validate(wire).to_sampling_params(5)
    assert {name: getattr(params, name) for name in NON_DEFAULT} == NON_DEFAULT
    assert params.max_tokens == 5


@pytest.mark.parametrize("body", BODIES, ids=lambda body: body.__name__)
def test_a_body_with_no_sampling_fields_gives_the_default_params(body):
    wire = {"model": "m"}
    wire.update({"messages": [{"role": "user", "content": "hi"}]} if body is ChatCompletionRequest else {})
    wire.update({"prompt": "hi"} if body is CompletionRequest else {})
    assert body.model_validate(wire).to_sampling_params(None) == SamplingParams(max_tokens=None)
