"""Structured outputs and tools through the HTTP server, on the synthetic model (no real model needed).

Every bad constraint is a 400 in the OpenAI error shape naming its param, and nothing reaches the engine
(the worker is never asked to submit). The synthetic tokenizer here has a trivial chat template that records
the ``tools`` it is given, so the chat route can be exercised without a real model.
"""

from __future__ import annotations

import httpx
import pytest

from pagedgen.models.synthetic import SyntheticModel, SyntheticTokenizer
from tests.server.doubles import VOCAB, app_state, serve

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


class ChatTokenizer(SyntheticTokenizer):
    """The synthetic codec with a chat template: ``role: content`` lines; remembers the tools it saw."""

    def __init__(self, vocab_size: int):
        super().__init__(vocab_size)
        self.seen_tools: list[object] = []

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None, **_variables) -> str:
        self.seen_tools.append(tools)
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        return "\n".join(lines) + ("\nassistant: " if add_generation_prompt else "")


@pytest.fixture(scope="module")
def server():
    tokenizer = ChatTokenizer(VOCAB)
    live = serve(SyntheticModel(vocab_size=VOCAB), tokenizer=tokenizer)
    worker = app_state(live).worker
    submitted = []
    original = worker.submit

    def counting_submit(*args, **kwargs):
        submitted.append(args)
        return original(*args, **kwargs)

    worker.submit = counting_submit
    live.submitted = submitted
    live.tokenizer = tokenizer
    yield live
    live.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": "synthetic", **body}, timeout=120)


def schema_format(schema: object) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


BOTH_ROUTES = [
    ({"response_format": schema_format({"type": "nope"})}, "response_format"),
    ({"response_format": schema_format({"$ref": "#/$defs/missing"})}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "[unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": {"type": "integer", "minimum": 5, "maximum": 1}}}, "structured_outputs.json"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs"),
]  # fmt: skip
CHAT_ONLY = [
    ({"tools": TOOLS}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"choice": ["a"]}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}], "tool_choice": "required"}, "tools"),
]  # fmt: skip


def _assert_refused(server, response: httpx.Response, param: str) -> dict:
    assert response.status_code == 400, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param, error
    assert server.submitted == [], "a refused request reached the engine worker"
    return error


@pytest.mark.parametrize(("fields", "param"), BOTH_ROUTES)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_bad_constraint_is_400_naming_its_param_on_both_routes(server, fields, param, stream):
    _assert_refused(
        server, post(server, "/v1/completions", {"prompt": "ab", "stream": stream, **fields}), param
    )
    _assert_refused(
        server, post(server, "/v1/chat/completions", {"messages": CHAT, "stream": stream, **fields}), param
    )


@pytest.mark.parametrize(("fields", "param"), CHAT_ONLY)
def test_a_bad_tool_request_is_400_naming_its_param(server, fields, param):
    error = _assert_refused(server, post(server, "/v1/chat/completions", {"messages": CHAT, **fields}), param)
    if fields.get("tool_choice", "auto") == "auto" and "tools" in fields:
        assert "required" in error["message"] and "parser" in error["message"]


def test_tools_are_not_a_completions_parameter(server):
    response = post(server, "/v1/completions", {"prompt": "ab", "tools": TOOLS, "tool_choice": "required"})
    _assert_refused(server, response, "tools")
