"""Structured outputs and tools through the live server on the default model, with the OpenAI client.

Every schema is bounded (``additionalProperties: false``, ``maxLength`` / ``pattern`` on strings, enums and
bounded integers), so every allowed output completes well within ``max_tokens``; ``"required"`` tool calls
use ``parallel_tool_calls=False`` (exactly one call) for the same reason. Requests run concurrently, so the
engine batches constrained and unconstrained turns together.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from tests.server.live import MODEL_NAME

pytestmark = pytest.mark.model

MAX_TOKENS = 200
CITY = {"type": "string", "pattern": "^[A-Z][a-z]{1,15}$"}
WEATHER = {
    "type": "object",
    "properties": {"city": CITY, "unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"type": "integer",
                   "minimum": 1, "maximum": 7}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}  # fmt: skip
FLIGHT = {
    "$defs": {"airport": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "type": "object",
    "properties": {
        "origin": {"$ref": "#/$defs/airport"},
        "destination": {"$ref": "#/$defs/airport"},
        "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
        "return_date": {
            "anyOf": [{"type": "string", "pattern": "^2026-[01][0-9]-[0-3][0-9]$"}, {"type": "null"}]
        },
    },
    "required": ["origin", "destination", "passengers", "return_date"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "book_flight", "description": "Book", "parameters": FLIGHT}},
]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {"type": "array", "items": {"enum": ["en", "fr", "de"]}, "maxItems": 3},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
ASK_PERSON = [{"role": "user", "content": "Describe a French programmer as JSON."}]
GREEDY = {"temperature": 0}
SEEDED = {"temperature": 1.0, "seed": 5}


def _chat(client, **kwargs):
    return client.chat.completions.create(model=MODEL_NAME, max_tokens=MAX_TOKENS, **kwargs)


def _calls(client, sampling, **kwargs):
    return _chat(client, messages=ASK_WEATHER, tools=TOOLS, **sampling, **kwargs).choices[0]


def test_constrained_outputs_through_the_server_are_valid(client):
    """Schema, tools and vLLM's structured_outputs, greedy and seeded, sent together with free requests."""
    schema_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    named = {"type": "function", "function": {"name": "book_flight"}}
    jobs = {}
    with ThreadPoolExecutor(8) as pool:
        for label, sampling in (("greedy", GREEDY), ("seeded", SEEDED)):
            jobs["person", label] = pool.submit(
                _chat, client, messages=ASK_PERSON, response_format=schema_format, **sampling
            )
            jobs["named", label] = pool.submit(_calls, client, sampling, tool_choice=named)
            jobs["required", label] = pool.submit(
                _calls, client, sampling, tool_choice="required", parallel_tool_calls=False
            )
        jobs["free"] = pool.submit(
            client.chat.completions.create, model=MODEL_NAME, messages=ASK_WEATHER, max_tokens=16, **GREEDY
        )
        jobs["object"] = pool.submit(
            client.completions.create,
            model=MODEL_NAME,
            prompt="A JSON object describing a dog:",
            max_tokens=MAX_TOKENS,
            extra_body={"structured_outputs": {"json": PERSON}},
            **GREEDY,
        )
        jobs["choice"] = pool.submit(
            client.completions.create,
            model=MODEL_NAME,
            prompt="Is the sky blue? Answer:",
            max_tokens=8,
            extra_body={"structured_outputs": {"choice": [" yes", " no", " it depends"]}},
            **SEEDED,
        )
        jobs["regex"] = pool.submit(
            _chat,
            client,
            messages=[{"role": "user", "content": "Give me a US phone number."}],
            extra_body={"structured_outputs": {"regex": r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"}},
            **GREEDY,
        )
    results = {key: job.result() for key, job in jobs.items()}
    for label in ("greedy", "seeded"):
        person = results["person", label].choices[0]
        assert person.finish_reason == "stop"
        jsonschema.validate(json.loads(person.message.content), PERSON)

        named_choice = results["named", label]
        assert named_choice.finish_reason == "stop" and named_choice.message.content is None
        (call,) = named_choice.message.tool_calls
        assert call.function.name == "book_flight" and call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), FLIGHT)

        required_choice = results["required", label]
        assert required_choice.finish_reason == "tool_calls"
        (call,) = required_choice.message.tool_calls
        schema = {"get_weather": WEATHER, "book_flight": FLIGHT}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), schema)
    assert results["free"].choices[0].finish_reason == "length"
    jsonschema.validate(json.loads(results["object"].choices[0].text), PERSON)
    assert results["choice"].choices[0].text in (" yes", " no", " it depends")
    phone = results["regex"].choices[0].message.content
    assert re.fullmatch(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", phone), phone


def test_streamed_tool_calls_equal_the_whole_response(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = _calls(client, GREEDY, tool_choice=named).message.tool_calls[0]
    stream = _chat(client, messages=ASK_WEATHER, tools=TOOLS, tool_choice=named, stream=True, **GREEDY)
    arguments, names, finish = [], [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for call in delta.tool_calls or ():
            names.append(call.function.name)
            arguments.append(call.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert names[0] == "get_weather" and "".join(arguments) == whole.function.arguments
    assert finish == "stop"
    jsonschema.validate(json.loads(whole.function.arguments), WEATHER)

    required = _calls(client, GREEDY, tool_choice="required", parallel_tool_calls=False).message.tool_calls
    stream = _chat(
        client,
        messages=ASK_WEATHER,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        stream=True,
        **GREEDY,
    )
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    streamed = chunks[-1].choices[0].delta.tool_calls
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in required
    ]


def test_the_openai_clients_parse_helper_gets_its_pydantic_model(client):
    """``client.chat.completions.parse`` sends a strict ``json_schema`` built from a pydantic model."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Forecast(BaseModel):
        city: str = Field(max_length=16)
        unit: Literal["celsius", "fahrenheit"]
        days: int = Field(ge=1, le=7)

    completion = client.chat.completions.parse(
        model=MODEL_NAME, messages=ASK_WEATHER, response_format=Forecast, max_tokens=MAX_TOKENS, temperature=0
    )
    message = completion.choices[0].message
    assert isinstance(message.parsed, Forecast)
    assert Forecast.model_validate_json(message.content) == message.parsed
