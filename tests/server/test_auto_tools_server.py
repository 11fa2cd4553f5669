"""``tool_choice: "auto"`` through the live server with the ``openai`` client, on a scripted synthetic model.

The :class:`ScriptedModel` writes a fixed reply per user message and keeps to it whatever the constraint
lets through, so each test knows the text the model "wants": a text answer, one call, two calls, a call
whose arguments go wrong after the opening tag. Its chat template has no ``tools`` variable, so the tools
reach it in the fallback system prompt (hermes format).
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.server.doubles import ScriptedModel, client_of, serve

PICK = {
    "type": "object",
    "properties": {
        "side": {"enum": ["left", "right"]},
        "count": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["side", "count"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "pick", "description": "Pick a side", "parameters": PICK}},
    {"type": "function", "function": {"name": "ping"}},
]
SCHEMAS = {"pick": PICK, "ping": {"type": "object", "properties": {}, "additionalProperties": False}}
ONE_CALL = '{"name": "pick", "arguments": {"side": "left", "count": 2}}'
SCRIPTS = {
    "call": f"Sure.\n<tool_call>\n{ONE_CALL}\n</tool_call>",
    "two": '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>\n<tool_call>\n'
    '{"name": "pick", "arguments": {"side": "right", "count": 3}}\n</tool_call>',
    "text": "Just text: no call, though it mentions <tool and {braces}.",
    # Wrong from the first argument on: a side not in the enum, a count that is a string, an extra key.
    "wrong": '<tool_call>\n{"name": "pick", "arguments": {"side": "middle", "count": "many", "x": 1}}'
    "\n</tool_call>",
    "unknown": '<tool_call>\n{"name": "launch", "arguments": {"when": "now"}}\n</tool_call>',
}  # fmt: skip


@pytest.fixture(scope="module")
def model():
    return ScriptedModel(SCRIPTS)


@pytest.fixture(scope="module")
def server(model):
    live = serve(model, tokenizer=model.codec)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return client_of(server)


def ask(client, key: str, **fields):
    fields = {"tools": TOOLS, "max_tokens": 300, **fields}
    messages = [{"role": "user", "content": key}]
    return client.chat.completions.create(model="synthetic", messages=messages, temperature=0, **fields)


def streamed(client, key: str, **fields):
    """The chunks of a stream, and the completion the ``openai`` client assembles from them."""
    chunks = list(ask(client, key, stream=True, **fields))
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    if chunks[-1].choices[0].finish_reason == "length":  # the client's final parse refuses a cut reply
        return chunks, state.current_completion_snapshot
    return chunks, state.get_final_completion()


def calls_of(message) -> list[tuple[str, str]]:
    return [(call.function.name, call.function.arguments) for call in message.tool_calls or []]


def assert_valid(message) -> None:
    for name, arguments in calls_of(message):
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("tool_choice", ["auto", None], ids=["auto", "no_tool_choice"])
def test_an_automatic_call_is_returned_as_tool_calls(client, model, tool_choice):
    fields = {} if tool_choice is None else {"tool_choice": tool_choice}
    model.codec.seen_tools.clear()
    reply = ask(client, "call", **fields)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Sure."
    assert calls_of(choice.message) == [("pick", '{"side": "left", "count": 2}')]
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert model.codec.seen_tools == [TOOLS]  # the template variable is given the tools as well


def test_the_tools_reach_a_template_without_them_in_a_system_prompt(client, server, model):
    model.codec.seen_messages.clear()
    ask(client, "text")
    (messages,) = model.codec.seen_messages
    assert [m["role"] for m in messages] == ["system", "user"]
    system = messages[0]["content"]
    assert "<tool_call>" in system and all(json.dumps(tool) in system for tool in TOOLS)
    model.codec.seen_messages.clear()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "text"}]
    body = {"model": "synthetic", "max_tokens": 5, "tools": TOOLS, "messages": messages}
    assert httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).status_code == 200
    (messages,) = model.codec.seen_messages
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\nYou may call these functions:")


def test_a_text_answer_stays_text(client):
    reply = ask(client, "text")
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content == SCRIPTS["text"]
    _chunks, assembled = streamed(client, "text")
    assert assembled.choices[0].message.content == SCRIPTS["text"]
    assert assembled.choices[0].finish_reason == "stop" and not assembled.choices[0].message.tool_calls


def test_a_stream_sends_the_text_then_openai_tool_call_deltas(client):
    chunks, assembled = streamed(client, "call")
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert deltas[0].role == "assistant"
    content = "".join(d.content or "" for d in deltas)
    assert content == "Sure."
    calls = [d.tool_calls for d in deltas if d.tool_calls]
    first = calls[0][0]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "pick" and first.function.arguments == ""
    rest = [c[0] for c in calls[1:]]
    assert all(c.index == 0 and c.id is None and c.function.name is None for c in rest)
    assert len(rest) > 5  # the arguments stream as they are generated, not in one piece
    assert "".join(c.function.arguments for c in rest) == '{"side": "left", "count": 2}'
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    message = assembled.choices[0].message
    assert message.content == "Sure." and calls_of(message) == [("pick", '{"side": "left", "count": 2}')]
    whole = ask(client, "call").choices[0].message
    assert calls_of(whole) == calls_of(message) and whole.content == message.content


def test_parallel_calls_are_all_returned_unless_parallel_tool_calls_is_false(client):
    two = [("ping", "{}"), ("pick", '{"side": "right", "count": 3}')]
    reply = ask(client, "two")
    assert reply.choices[0].finish_reason == "tool_calls" and calls_of(reply.choices[0].message) == two
    _chunks, assembled = streamed(client, "two")
    assert calls_of(assembled.choices[0].message) == two
    assert [c.index for c in assembled.choices[0].message.tool_calls] == [0, 1]
    single = ask(client, "two", parallel_tool_calls=False)
    choice = single.choices[0]
    assert choice.finish_reason == "tool_calls" and calls_of(choice.message) == [("ping", "{}")]
    assert choice.message.content is None
    first_call = SCRIPTS["two"].index("</tool_call>") + len("</tool_call>")
    assert single.usage.completion_tokens == first_call  # the reply ended there: one token a character


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_an_automatic_call_whose_arguments_go_wrong_still_validates(client, stream, model):
    """The model opens a call and then writes arguments its schema forbids: the constraint keeps every
    character valid, so the call still parses and validates (not vLLM's behaviour: its parsers return what
    the model wrote)."""
    if stream:
        message = streamed(client, "wrong")[1].choices[0].message
    else:
        reply = ask(client, "wrong")
        assert reply.choices[0].finish_reason == "tool_calls"
        message = reply.choices[0].message
    ((name, arguments),) = calls_of(message)
    assert name == "pick"
    jsonschema.validate(json.loads(arguments), PICK)
    assert arguments != '{"side": "middle", "count": "many", "x": 1}'
    unknown = ask(client, "unknown").choices[0].message  # a function that is not among the tools
    assert [name for name, _ in calls_of(unknown)] in (["pick"], ["ping"])
    assert_valid(unknown)


def test_a_call_cut_by_max_tokens_keeps_what_was_generated(client):
    reply = ask(client, "call", max_tokens=55)
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    ((name, arguments),) = calls_of(choice.message)
    prefix = f"Sure.\n<tool_call>\n{ONE_CALL}"[:55]
    assert name == "pick" and prefix.endswith(arguments) and arguments == prefix.split('"arguments": ')[1]
    chunks, assembled = streamed(client, "call", max_tokens=55)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert calls_of(assembled.choices[0].message) == [(name, arguments)]


def test_n_choices_each_parse_their_calls(client):
    reply = ask(client, "call", n=2)
    assert [c.finish_reason for c in reply.choices] == ["tool_calls", "tool_calls"]
    assert [calls_of(c.message) for c in reply.choices] == [[("pick", '{"side": "left", "count": 2}')]] * 2
    ids = [c.message.tool_calls[0].id for c in reply.choices]
    assert len(set(ids)) == 2


def test_tool_choice_none_and_forced_calls_are_unchanged(client):
    none = ask(client, "call", tool_choice="none").choices[0]
    assert none.finish_reason == "stop" and none.message.tool_calls is None
    assert none.message.content == SCRIPTS["call"]


def test_auto_tool_choice_off_is_a_400_naming_tool_choice(model):
    live = serve(model, tokenizer=model.codec, enable_auto_tool_choice=False)
    try:
        client = client_of(live)
        for fields in ({}, {"tool_choice": "auto"}):
            with pytest.raises(openai.BadRequestError) as info:
                ask(client, "call", **fields)
            error = info.value.body
            assert error["param"] == "tool_choice"
            assert "--no-enable-auto-tool-choice" in error["message"] and "required" in error["message"]
        forced = ask(client, "call", tool_choice="required", parallel_tool_calls=False)  # no parser needed
        assert forced.choices[0].finish_reason == "tool_calls"
        assert ask(client, "text", tools=None).choices[0].message.content == SCRIPTS["text"]
    finally:
        live.stop()


def test_tokenize_counts_the_chat_prompt_of_a_request_with_tools(client, server):
    """``/tokenize`` renders a chat sent with tools as the chat route does by default ("auto"): with the
    fallback system prompt on a template without ``tools``."""
    messages = [{"role": "user", "content": "text"}]
    count = httpx.post(server.url + "/tokenize", json={"messages": messages, "tools": TOOLS}, timeout=120)
    assert count.status_code == 200
    usage = ask(client, "text").usage.prompt_tokens
    assert count.json()["count"] == usage
    plain = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=120).json()["count"]
    assert plain < usage
