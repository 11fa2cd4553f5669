"""The wire side of structured outputs and tools, without a model: request parsing, the constraint each
request becomes, the tool-call schemas, and the response payloads built from generated text."""

from __future__ import annotations

import json

import jsonschema
import pydantic
import pytest

from pagedgen.engine.events import FinishReason
from pagedgen.errors import EngineErrorCode, SamplingOptionsError
from pagedgen.server.protocol import ChatCompletionRequest, CompletionRequest
from pagedgen.server.responses import ChatResponses
from pagedgen.server.tools import NO_PARAMETERS, ForcedToolCalls, parse_required_calls, required_schema
from pagedgen.server.worker import Finish
from tests.helpers import guidance_accepts as accepts

CHAT = [{"role": "user", "content": "Hi"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"$ref": "#/$defs/zone"}},
    "required": ["zone"],
    "additionalProperties": False,
    "$defs": {"zone": {"enum": ["UTC", "CET"]}},
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "now", "parameters": TIME}},
    {"type": "function", "function": {"name": "ping"}},
]


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": CHAT, **fields})


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields})


def constraint(request):
    params = request.to_sampling_params(64)
    return None if params.structured_outputs is None else params.structured_outputs.guidance()


def refusal(request) -> SamplingOptionsError:
    with pytest.raises(SamplingOptionsError) as info:
        request.to_sampling_params(64)
    return info.value


@pytest.mark.parametrize("make", [chat, completion], ids=["chat", "completions"])
def test_response_format_and_structured_outputs_become_one_constraint(make):
    assert constraint(make()) is None
    assert constraint(make(response_format={"type": "text"})) is None
    assert constraint(make(response_format={"type": "json_object"})) == ("json_schema", {"type": "object"})
    schema_format = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER, "strict": True}}
    assert constraint(make(response_format=schema_format)) == ("json_schema", WEATHER)
    assert constraint(make(structured_outputs={"json": WEATHER})) == ("json_schema", WEATHER)
    assert constraint(make(structured_outputs={"json": json.dumps(WEATHER)})) == (
        "json_schema",
        json.dumps(WEATHER),
    )
    assert constraint(make(structured_outputs={"regex": "[a-z]+"})) == ("regex", "[a-z]+")
    assert constraint(make(structured_outputs={"choice": ["a", 'b"']})) == (
        "lark_grammar",
        'start: "a" | "b\\""',
    )
    assert constraint(make(structured_outputs={"grammar": 'start: "x"'})) == ("lark_grammar", 'start: "x"')
    assert constraint(make(structured_outputs={"json_object": True})) == ("json_schema", {"type": "object"})
    text_and_structured = make(response_format={"type": "text"}, structured_outputs={"regex": "a"})
    assert constraint(text_and_structured) == ("regex", "a")
    assert make(structured_outputs={"regex": "a"}).constrains_output
    assert not make(response_format={"type": "text"}).constrains_output


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": _schema_format({"type": "nope"})}, "response_format.json_schema.schema"),
        ({"response_format": _schema_format({"$ref": "#/no"})}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
         "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "(("}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "start: nothing_here"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"json": "{bad"}}, "structured_outputs.json"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("make", [chat, completion], ids=["chat", "completions"])
def test_a_bad_constraint_names_its_param(make, fields, param):
    error = refusal(make(**fields))
    assert error.field == param


@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": {"type": "xml"}},
        {"response_format": {"type": "json_schema"}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
        {"response_format": {"type": "json_object", "schema": {}}},
        {"structured_outputs": {"regexp": "a"}},
        {"structured_outputs": {"choice": "a"}},
        {"structured_outputs": {"json": 5}},
    ],
)
def test_a_malformed_constraint_is_a_validation_error(fields):
    with pytest.raises(pydantic.ValidationError) as info:
        chat(**fields)
    assert info.value.errors()[0]["loc"][0] == next(iter(fields))


def test_a_named_tool_choice_constrains_to_that_functions_parameters():
    request = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert constraint(request) == ("json_schema", WEATHER)
    assert request.forced_tool_calls == ForcedToolCalls("get_weather")
    assert [t["function"]["name"] for t in request.template_tools] == ["get_weather", "get_time", "ping"]
    ping = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "ping"}})
    kind, schema = constraint(ping)
    assert schema == NO_PARAMETERS
    assert accepts(kind, schema, "{}") and not accepts(kind, schema, '{"a":1}')


def test_required_tool_choice_constrains_to_a_list_of_calls_of_the_tools():
    request = chat(tools=TOOLS, tool_choice="required")
    assert request.forced_tool_calls == ForcedToolCalls(None) and request.forced_tool_calls.required
    kind, schema = constraint(request)
    assert schema["$defs"] == {"zone": {"enum": ["UTC", "CET"]}}  # hoisted: the ref resolves at the root
    jsonschema.Draft202012Validator.check_schema(schema)
    valid = [
        [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}],
        [{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "ping", "parameters": {}}],
    ]
    invalid = [
        [],
        [{"name": "get_time", "parameters": {"city": "Paris", "unit": "C"}}],  # another tool's arguments
        [{"name": "get_time", "parameters": {"zone": "PST"}}],
        [{"name": "unknown", "parameters": {}}],
        [{"name": "ping", "parameters": {}, "extra": 1}],
        {"name": "ping", "parameters": {}},
    ]
    for value in valid:
        jsonschema.validate(value, schema)
        assert accepts(kind, schema, json.dumps(value)), value
    for value in invalid:
        assert not jsonschema.Draft202012Validator(schema).is_valid(value), value
        assert not accepts(kind, schema, json.dumps(value)), value
    single = constraint(chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False))[1]
    assert single["maxItems"] == 1 and "maxItems" not in schema


def test_required_schema_refuses_tools_that_define_one_name_differently():
    other = {
        "type": "object",
        "properties": {"z": {"$ref": "#/$defs/zone"}},
        "$defs": {"zone": {"type": "null"}},
    }
    with pytest.raises(SamplingOptionsError) as info:
        required_schema([("a", TIME), ("b", other)], parallel=True)
    assert info.value.field == "tools[1].function.parameters"
    same = required_schema([("a", TIME), ("b", TIME)], parallel=True)
    assert same["$defs"] == TIME["$defs"] and "$defs" in TIME  # the caller's schema is not changed


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"tools": TOOLS}, "tool_choice", ["auto", "required", "named function"]),
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", ["auto", "parser"]),
        ({"tool_choice": "required"}, "tool_choice", ["no tools"]),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
         ["nope", "get_weather"]),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
          "tool_choice": "required"}, "tools[0].function.parameters", ["tools[0].function.parameters"]),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice", ["response_format"]),
        ({"tools": [*TOOLS, TOOLS[2]], "tool_choice": "required"}, "tools[3].function.name", ["ping"]),
        ({"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"regex": "a"}}, "tool_choice",
         ["structured_outputs"]),
    ],
)  # fmt: skip
def test_a_bad_tool_request_names_its_param(fields, param, words):
    error = refusal(chat(**fields))
    assert error.field == param
    for word in words:
        assert word in str(error)


def test_tool_choice_none_ignores_the_tools():
    request = chat(tools=TOOLS, tool_choice="none")
    assert constraint(request) is None
    assert request.forced_tool_calls is None and request.template_tools is None
    bad_but_ignored = [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]
    assert constraint(chat(tools=bad_but_ignored, tool_choice="none")) is None


@pytest.mark.parametrize(
    "fields",
    [
        {"tools": []},
        {"tools": [{"type": "function", "function": {"name": "has space"}}]},
        {"tools": [{"type": "retrieval", "function": {"name": "f"}}]},
        {"tool_choice": "sometimes"},
        {"tool_choice": {"type": "function", "function": {}}},
    ],
)
def test_malformed_tools_are_validation_errors(fields):
    with pytest.raises(pydantic.ValidationError):
        chat(**fields)


def test_tool_messages_reach_the_template():
    call = {"id": "call_1", "type": "function", "function": {"name": "ping", "arguments": "{}"}}
    request = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "ping it"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "pong", "tool_call_id": "call_1"},
            ],
        }
    )
    messages = [m.as_template_message() for m in request.messages]
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert messages[2] == {"role": "tool", "content": "pong", "tool_call_id": "call_1"}


def test_parse_required_calls():
    text = '[{"name":"get_time","parameters":{"zone":"UTC"}},{"name":"ping","parameters":{}}]'
    assert parse_required_calls(text) == [("get_time", '{"zone": "UTC"}'), ("ping", "{}")]
    assert parse_required_calls('[{"name":"é","parameters":{"a":"ü"}}]') == [("é", '{"a": "ü"}')]
    for broken in ['[{"name":"ping","parameters":{', "[]", "{}", '[{"parameters":{}}]', '[{"name":"p"}]']:
        assert parse_required_calls(broken) is None


FINISH = Finish(FinishReason.EOS, 3, 4, 0, None, EngineErrorCode.NONE)


def _builder(tools):
    return ChatResponses("m", tokenizer=None, logprobs=None, include_usage=False, tools=tools)


def test_a_named_call_answers_tool_calls_with_the_arguments_as_generated():
    body = _builder(ForcedToolCalls("get_weather")).full('{"city":"Oslo","unit":"C"}', [], "stop", FINISH)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    message = choice["message"]
    assert message["content"] is None and message["role"] == "assistant"
    (call,) = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city":"Oslo","unit":"C"}'}


def test_a_required_list_answers_one_call_each_with_finish_reason_tool_calls():
    text = '[{"name":"get_time","parameters":{"zone":"UTC"}},{"name":"ping","parameters":{}}]'
    choice = _builder(ForcedToolCalls(None)).full(text, [], "stop", FINISH)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    calls = choice["message"]["tool_calls"]
    assert [c["function"] for c in calls] == [
        {"name": "get_time", "arguments": '{"zone": "UTC"}'},
        {"name": "ping", "arguments": "{}"},
    ]
    assert len({c["id"] for c in calls}) == 2 and choice["message"]["content"] is None
    cut = _builder(ForcedToolCalls(None)).full(text[:20], [], "length", FINISH)["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["content"] == text[:20]
    assert cut["message"]["tool_calls"] is None


def test_a_named_call_streams_its_arguments_and_a_required_list_streams_once_parsed():
    named = _builder(ForcedToolCalls("ping"))
    first = named.first_chunk()["choices"][0]["delta"]
    assert first["role"] == "assistant" and first["content"] is None
    (head,) = first["tool_calls"]
    assert head["index"] == 0 and head["function"] == {"name": "ping", "arguments": ""} and head["id"]
    deltas = [named.chunk(part, [], None)["choices"][0]["delta"] for part in ("{", "}")]
    assert deltas == [{"tool_calls": [{"index": 0, "function": {"arguments": p}}]} for p in ("{", "}")]
    last = named.chunk("", [], "stop")["choices"][0]
    assert last["delta"] == {} and last["finish_reason"] == "stop"

    required = _builder(ForcedToolCalls(None))
    assert required.first_chunk()["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert required.chunk('[{"name":"ping",', [], None) is None
    final = required.chunk('"parameters":{}}]', [], "stop")["choices"][0]
    assert final["finish_reason"] == "tool_calls"
    (call,) = final["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "ping", "arguments": "{}"}
