"""Structured outputs and tools through the HTTP server, on the synthetic model (no real model needed).

Every bad constraint is a 400 in the OpenAI error shape naming its param, and nothing reaches the engine
(the worker is never asked to submit). The synthetic tokenizer here has a trivial chat template that records
the ``tools`` it is given, so the chat route can be exercised without a real model.
"""

from __future__ import annotations

import json
import re
import threading

import httpx
import jsonschema
import pytest

from pagedgen.models.synthetic import SyntheticModel
from tests.server.doubles import VOCAB, ChatTokenizer, app_state, serve_counting_submits

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "pick",
            "parameters": {
                "type": "object",
                "properties": {"side": {"enum": ["left", "right"]}},
                "required": ["side"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "ping"}},
]
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server():
    live = serve_counting_submits(SyntheticModel(vocab_size=VOCAB), ChatTokenizer(VOCAB))
    yield live
    live.stop()


def settled_snapshot(server):
    """The worker's counters once it has applied every command queued so far."""
    done = threading.Event()
    found = []
    app_state(server).worker.sync(lambda snapshot: (found.append(snapshot), done.set()))
    assert done.wait(timeout=120)
    return found[0]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": "synthetic", **body}, timeout=120)


def schema_format(schema: object) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


BOTH_ROUTES = [
    ({"response_format": schema_format({"type": "nope"})}, "response_format.json_schema.schema"),
    ({"response_format": schema_format({"$ref": "#/$defs/missing"})}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "[unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": {"type": "integer", "minimum": 5, "maximum": 1}}},
     "structured_outputs.json"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
]  # fmt: skip
CHAT_ONLY = [
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),  # "auto", the default with tools
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
      "tool_choice": "auto"}, "tools[0].function.parameters"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"choice": ["a"]}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}], "tool_choice": "required"},
     "tools[0].function.name"),
]  # fmt: skip


def refused(server, path: str, body: dict, param: str) -> dict:
    """POST ``body``: a 400 in the OpenAI error shape naming ``param``; nothing reaches the worker."""
    before = len(server.submitted)
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    assert set(response.json()) == {"error"}
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param, error
    assert len(server.submitted) == before, "a refused request reached the engine worker"
    return error


@pytest.mark.parametrize(("fields", "param"), BOTH_ROUTES)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_bad_constraint_is_400_naming_its_param_on_both_routes(server, fields, param, stream):
    refused(server, "/v1/completions", {"prompt": "ab", "stream": stream, **fields}, param)
    refused(server, "/v1/chat/completions", {"messages": CHAT, "stream": stream, **fields}, param)


@pytest.mark.parametrize(("fields", "param"), CHAT_ONLY)
def test_a_bad_tool_request_is_400_naming_its_param(server, fields, param):
    refused(server, "/v1/chat/completions", {"messages": CHAT, **fields}, param)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_grammar_the_models_tokenizer_refuses_is_400_before_the_engine(server, stream):
    """Token 500 compiles as a grammar but not for a 95-token vocabulary: the route checks it too."""
    body = {"stream": stream, "structured_outputs": {"grammar": "start: <[500]>"}}
    error = refused(server, "/v1/completions", {"prompt": "ab", **body}, "structured_outputs.grammar")
    assert "tokenizer" in error["message"]
    error = refused(server, "/v1/chat/completions", {"messages": CHAT, **body}, "structured_outputs.grammar")
    assert "tokenizer" in error["message"]


def test_tools_are_not_a_completions_parameter(server):
    refused(server, "/v1/completions", {"prompt": "ab", "tools": TOOLS, "tool_choice": "required"}, "tools")


# ---------------------------------------------------------------- constrained output, end to end

PICK_SCHEMA = TOOLS[0]["function"]["parameters"]
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", 'no "way"', "back\\slash", "a|b"]


def stream_events(server, path: str, body: dict) -> list[dict]:
    """The ``data`` payloads of a streamed response (``[DONE]`` checked and dropped)."""
    payload = {"model": "synthetic", "stream": True, **body}
    with httpx.stream("POST", server.url + path, json=payload, timeout=120) as response:
        assert response.status_code == 200, response.read()
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def completion_text(server, body: dict) -> tuple[str, str, str]:
    """(text, finish_reason) of a completion, and the text its stream delivers (must be the same)."""
    response = post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    chunks = stream_events(server, "/v1/completions", body)
    streamed = "".join(chunk["choices"][0]["text"] for chunk in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]
    return choice["text"], choice["finish_reason"], streamed


@pytest.mark.parametrize("prompt", ["ab", "hello there", [5, 9, 40]])
@pytest.mark.parametrize(
    "sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 3}], ids=["greedy", "seeded"]
)
def test_regex_and_choice_outputs_match_and_stream_the_same(server, prompt, sampling):
    cases = [
        ({"regex": REGEX}, lambda text: re.fullmatch(REGEX, text)),
        ({"choice": CHOICES}, lambda text: text in CHOICES),
        (
            {"grammar": 'start: "<" WORD ">"\nWORD: /[a-z]{1,5}/'},
            lambda text: re.fullmatch("<[a-z]{1,5}>", text),
        ),
    ]
    for structured, valid in cases:
        body = {"prompt": prompt, "max_tokens": 40, "structured_outputs": structured, **sampling}
        text, finish, streamed = completion_text(server, body)
        assert valid(text), (structured, text)
        assert finish == "stop" and streamed == text


def test_response_format_json_schema_on_chat_validates(server):
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["left", "right"]}, "sure": {"type": "boolean"}},
        "required": ["answer", "sure"],
        "additionalProperties": False,
    }
    body = {"messages": CHAT, "max_tokens": 60, "temperature": 0, "response_format": schema_format(schema)}
    response = post(server, "/v1/chat/completions", body)
    choice = response.json()["choices"][0]
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    assert choice["finish_reason"] == "stop"
    chunks = stream_events(server, "/v1/chat/completions", body)
    streamed = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks)
    assert streamed == choice["message"]["content"]


def test_a_named_tool_call_returns_valid_arguments_and_streams_them(server):
    body = {
        "messages": CHAT,
        "max_tokens": 60,
        "temperature": 0,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "pick"}},
    }
    server.tokenizer.seen_tools.clear()
    message = post(server, "/v1/chat/completions", body).json()["choices"][0]
    assert message["finish_reason"] == "stop"
    assert message["message"]["content"] is None
    (call,) = message["message"]["tool_calls"]
    assert (
        call["type"] == "function" and call["function"]["name"] == "pick" and call["id"].startswith("call_")
    )
    jsonschema.validate(json.loads(call["function"]["arguments"]), PICK_SCHEMA)
    assert server.tokenizer.seen_tools == [TOOLS]  # the template was given the tools

    chunks = stream_events(server, "/v1/chat/completions", body)
    (head,) = chunks[0]["choices"][0]["delta"]["tool_calls"]
    assert head["function"] == {"name": "pick", "arguments": ""} and head["id"].startswith("call_")
    arguments = "".join(
        delta["tool_calls"][0]["function"]["arguments"]
        for chunk in chunks[1:]
        if (delta := chunk["choices"][0]["delta"])
    )
    assert arguments == call["function"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"

    ping = {**body, "tool_choice": {"type": "function", "function": {"name": "ping"}}}
    (call,) = post(server, "/v1/chat/completions", ping).json()["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "ping", "arguments": "{}"}  # no parameters: exactly an empty object


def test_required_tool_calls_are_parsed_and_sent_once_in_the_stream(server):
    body = {
        "messages": CHAT,
        "max_tokens": 120,
        "temperature": 0,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
    }
    choice = post(server, "/v1/chat/completions", body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    schemas = {tool["function"]["name"]: tool["function"].get("parameters") for tool in TOOLS}
    assert call["function"]["name"] in schemas
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(
        arguments, schemas[call["function"]["name"]] or {"type": "object", "maxProperties": 0}
    )

    chunks = stream_events(server, "/v1/chat/completions", body)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert all(chunk["choices"][0]["delta"] == {} for chunk in chunks[1:-1])  # held until parsed
    last = chunks[-1]["choices"][0]
    assert last["finish_reason"] == "tool_calls"
    (streamed,) = last["delta"]["tool_calls"]
    assert streamed["index"] == 0 and streamed["function"] == call["function"]


def test_required_output_cut_by_max_tokens_comes_back_as_content(server):
    """With parallel calls allowed the synthetic model keeps adding calls: the array never closes."""
    body = {"messages": CHAT, "max_tokens": 30, "temperature": 0, "tools": TOOLS, "tool_choice": "required"}
    choice = post(server, "/v1/chat/completions", body).json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["tool_calls"] is None and choice["message"]["content"].startswith('[{"name":')
    last = stream_events(server, "/v1/chat/completions", body)[-1]["choices"][0]
    assert last["finish_reason"] == "length" and last["delta"] == {"content": choice["message"]["content"]}


def test_tool_choice_none_ignores_the_tools(server):
    server.tokenizer.seen_tools.clear()
    body = {"messages": CHAT, "max_tokens": 5, "temperature": 0, "tools": TOOLS, "tool_choice": "none"}
    choice = post(server, "/v1/chat/completions", body).json()["choices"][0]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert len(choice["message"]["content"]) == 5
    assert server.tokenizer.seen_tools == [None]


def test_nothing_is_left_behind(server):
    """After every test above (file order): no block is held, no job is open."""
    snapshot = settled_snapshot(server)
    assert snapshot.free_blocks == snapshot.total_blocks and snapshot.jobs == 0
