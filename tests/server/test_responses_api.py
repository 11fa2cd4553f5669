"""The Responses API (``client.responses.create``) on the synthetic model, through the real ``openai`` client.

The synthetic model's greedy continuation is a closed formula of the whole sequence and the test tokenizer's
chat template writes ``role: content`` lines, so every answer's text and every prompt's length is known
exactly: a follow-up served in its previous response's still-open Request must answer what a fresh
computation of the whole conversation answers, while computing only its new tokens.
"""

from __future__ import annotations

import concurrent.futures
import json
from typing import Annotated

import httpx
import jsonschema
import openai
import pydantic
import pytest

import pagedgen.server.worker as worker_module
from pagedgen.models.synthetic import SyntheticModel, SyntheticTokenizer, synthetic_greedy
from pagedgen.server.responses_api.store import StoreLimits
from tests.server.doubles import VOCAB, ChatTokenizer, app_state, client_of, serve, settled_metrics
from tests.server.live import metric

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


BLOCK = 16  # the engine's default block size: the prefix cache shares whole blocks


def _serve(**options):
    return serve(SyntheticModel(vocab_size=VOCAB), tokenizer=ChatTokenizer(VOCAB), **options)


@pytest.fixture(scope="module")
def server():
    live = _serve()
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server):
    return client_of(server)


def rendered(*lines: str) -> str:
    """The test template's prompt: one ``role: content`` line per message, then the assistant's opening."""
    return "\n".join(lines) + "\nassistant: "


def greedy_text(prompt: str, max_tokens: int) -> str:
    ids = SyntheticTokenizer(VOCAB).encode(prompt)
    return SyntheticTokenizer(VOCAB).decode(synthetic_greedy(ids, max_tokens, VOCAB))


def create(client, **fields):
    return client.responses.create(model="synthetic", temperature=0, **fields)


def test_text_input_answers_the_templated_prompt(client):
    prompt = rendered("system: Be brief.", "user: hello")
    response = create(client, input="hello", instructions="Be brief.", max_output_tokens=5)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == greedy_text(prompt, 5)
    assert [item.type for item in response.output] == ["message"]
    assert response.output[0].role == "assistant"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == len(prompt)
    assert response.usage.output_tokens == 5
    assert response.usage.total_tokens == len(prompt) + 5
    assert response.instructions == "Be brief." and response.max_output_tokens == 5
    items = [
        {"role": "system", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello"}]},
    ]
    assert create(client, input=items, max_output_tokens=5).output_text == response.output_text


def test_sampling_with_a_seed_is_reproducible(client):
    def sample(seed):
        response = client.responses.create(
            model="synthetic",
            input="roll",
            temperature=1.5,
            top_p=0.9,
            max_output_tokens=12,
            extra_body={"seed": seed},
        )
        return response.output_text

    assert sample(7) == sample(7)
    assert len({sample(seed) for seed in (1, 2, 3)}) > 1


def test_streaming_events_come_in_order_with_sequence_numbers(client):
    prompt = rendered("user: stream me")
    stream = create(client, input="stream me", max_output_tokens=6, stream=True)
    events = list(stream)
    types = [event.type for event in events]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 6,  # one token, one character, one delta
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    expected = greedy_text(prompt, 6)
    assert "".join(event.delta for event in events if event.type == "response.output_text.delta") == expected
    created, added, done, last = events[0], events[2], events[-2], events[-1]
    assert created.response.status == "in_progress" and created.response.output == []
    assert added.item.type == "message" and added.item.status == "in_progress" and added.output_index == 0
    assert all(e.item_id == added.item.id for e in events[3:-2] if hasattr(e, "item_id"))
    assert events[-4].text == expected and done.item.content[0].text == expected
    assert last.response.id == created.response.id and last.response.output_text == expected
    assert last.response.usage.input_tokens == len(prompt)


def test_a_named_function_is_called_with_arguments_that_follow_its_schema(client):
    response = create(
        client,
        input="weather?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
    )
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert response.tools[0].name == "get_weather"


def test_a_streamed_function_call_sends_its_arguments_as_deltas(client):
    stream = create(
        client,
        input="weather?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
        stream=True,
    )
    events = list(stream)
    types = [event.type for event in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(types[3:-3]) == {"response.function_call_arguments.delta"}
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert events[-3].arguments == arguments == events[-2].item.arguments
    assert events[2].item.name == "get_weather" and events[-2].item.call_id == events[2].item.call_id
    jsonschema.validate(json.loads(arguments), WEATHER["parameters"])


def test_required_tool_call_and_its_output_on_the_next_turn(client):
    first = create(
        client,
        input="weather?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
    )
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert first.status == "completed" and first.parallel_tool_calls is False
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    follow = create(
        client,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "22C"}],
        max_output_tokens=4,
    )
    # The assistant turn that only called (no text), then the tool's answer, in the template's lines.
    prompt = rendered("user: weather?", "assistant: ", "tool: 22C")
    assert follow.usage.input_tokens == len(prompt)
    assert follow.output_text == greedy_text(prompt, 4)
    # The same history sent back as items, without previous_response_id, is the same prompt.
    items = [
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {
            "type": "function_call_output",
            "call_id": call.call_id,
            "output": [{"type": "input_text", "text": "22C"}],
        },
    ]
    again = create(client, input=items, max_output_tokens=4)
    assert again.output_text == follow.output_text and again.usage.input_tokens == len(prompt)


def test_text_format_json_schema_output_validates(client):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    response = create(
        client,
        input="a person",
        text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}},
        max_output_tokens=60,
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"
    # json_object: the synthetic model's free key runs past any small limit, but it is an object's start.
    as_object = create(client, input="any", text={"format": {"type": "json_object"}}, max_output_tokens=8)
    assert as_object.output_text.startswith("{") and greedy_text(rendered("user: any"), 8)[0] != "{"
    plain = create(client, input="any", text={"format": {"type": "text"}}, max_output_tokens=8)
    assert plain.output_text == greedy_text(rendered("user: any"), 8)


@pytest.mark.parametrize("tool_choice", [None, "auto", "none"])
def test_tool_choice_auto_and_none_answer_as_the_chat_route_does(server, tool_choice):
    """One implementation: whatever the chat route answers for these tools (a refusal naming the field,
    text, or tool calls), the Responses route answers the same, in its own shape."""
    choice = {} if tool_choice is None else {"tool_choice": tool_choice}
    chat_tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    chat = httpx.post(
        server.url + "/v1/chat/completions",
        json={
            "model": "synthetic",
            "messages": [{"role": "user", "content": "weather?"}],
            "tools": chat_tools,
            "max_tokens": 30,
            "temperature": 0,
            **choice,
        },
        timeout=120,
    )
    reply = httpx.post(
        server.url + "/v1/responses",
        json={
            "model": "synthetic",
            "input": "weather?",
            "tools": [WEATHER],
            "max_output_tokens": 30,
            "temperature": 0,
            **choice,
        },
        timeout=120,
    )
    assert reply.status_code == chat.status_code
    if chat.status_code != 200:
        assert reply.json()["error"]["param"] == chat.json()["error"]["param"]
        assert reply.json()["error"]["message"] == chat.json()["error"]["message"]
        return
    message = chat.json()["choices"][0]["message"]
    output = reply.json()["output"]
    texts = [part["text"] for item in output if item["type"] == "message" for part in item["content"]]
    assert "".join(texts) == (message["content"] or "")
    calls = [(item["name"], item["arguments"]) for item in output if item["type"] == "function_call"]
    assert calls == [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or ()
    ]


class Verdict(pydantic.BaseModel):
    ok: bool
    note: Annotated[str, pydantic.Field(max_length=5)]


def test_the_clients_stream_manager_and_parse_helpers(client):
    """``responses.stream`` rebuilds the response from the events (and checks their order and identities);
    ``responses.parse`` reads the output into the pydantic model its schema came from."""
    parsed = client.responses.parse(
        model="synthetic", input="judge", text_format=Verdict, max_output_tokens=60, temperature=0
    )
    assert isinstance(parsed.output_parsed, Verdict)
    with client.responses.stream(
        model="synthetic", input="judge", text_format=Verdict, max_output_tokens=60, temperature=0
    ) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_parsed == parsed.output_parsed and "".join(deltas) == final.output_text
    with client.responses.stream(
        model="synthetic",
        input="weather?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
        temperature=0,
    ) as stream:
        final = stream.get_final_response()
    (call,) = final.output
    assert call.type == "function_call" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_a_follow_up_continues_in_the_open_request_and_computes_only_its_new_tokens():
    live = _serve()
    try:
        client = client_of(live)
        first = create(client, input="hello", max_output_tokens=5)
        before = settled_metrics(live)
        assert metric(before, "pagedgen:num_requests_kept", model_name="synthetic") == 1
        second = create(client, input="again", previous_response_id=first.id, max_output_tokens=5)
        conversation = rendered("user: hello", f"assistant: {first.output_text}", "user: again")
        # What a fresh computation of the whole conversation answers, from the open Request's history.
        assert second.output_text == greedy_text(conversation, 5)
        assert second.previous_response_id == first.id
        assert second.usage.input_tokens == len(conversation)
        held = len(rendered("user: hello")) + 5 - 1  # the first turn's last token was never fed back
        assert second.usage.input_tokens_details.cached_tokens == held
        after = settled_metrics(live)
        assert metric(after, "pagedgen:num_turns_resumed_total", model_name="synthetic") == 1
        assert metric(after, "pagedgen:num_requests_kept", model_name="synthetic") == 1  # moved to second
        assert metric(after, "pagedgen:prefix_cache_queries_total", model_name="synthetic") == metric(
            before, "pagedgen:prefix_cache_queries_total", model_name="synthetic"
        )  # a resident continuation looks nothing up
        # The first response's Request now serves the second: a second follow-up of the first response
        # runs in a fresh Request, and the prefix cache serves the full blocks of what it shares.
        branch = create(client, input="other", previous_response_id=first.id, max_output_tokens=5)
        branched = rendered("user: hello", f"assistant: {first.output_text}", "user: other")
        assert branch.output_text == greedy_text(branched, 5)
        shared = len(rendered("user: hello", f"assistant: {first.output_text}", "user: "))
        assert branch.usage.input_tokens_details.cached_tokens == shared // BLOCK * BLOCK  # full blocks
        final = settled_metrics(live)
        assert metric(final, "pagedgen:num_turns_resumed_total", model_name="synthetic") == 1
        assert metric(final, "pagedgen:num_requests_kept", model_name="synthetic") == 2
    finally:
        live.stop()


def test_two_follow_ups_of_one_response_at_once_both_answer_and_one_resumes():
    live = _serve()
    try:
        client = client_of(live)
        first = create(client, input="hello", max_output_tokens=5)
        texts = ("left", "right")
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futures = [
                pool.submit(create, client, input=t, previous_response_id=first.id, max_output_tokens=5)
                for t in texts
            ]
            replies = [future.result() for future in futures]
        for text, reply in zip(texts, replies, strict=True):
            conversation = rendered("user: hello", f"assistant: {first.output_text}", f"user: {text}")
            assert reply.output_text == greedy_text(conversation, 5)
        metrics = settled_metrics(live)
        assert metric(metrics, "pagedgen:num_turns_resumed_total", model_name="synthetic") == 1
        assert metric(metrics, "pagedgen:num_requests_kept", model_name="synthetic") == 2
    finally:
        live.stop()


def test_a_follow_up_with_other_sampling_options_runs_in_a_fresh_request():
    live = _serve()
    try:
        client = client_of(live)
        first = create(client, input="hello", max_output_tokens=5)
        second = client.responses.create(
            model="synthetic",
            input="again",
            previous_response_id=first.id,
            max_output_tokens=5,
            temperature=0,
            extra_body={"seed": 5},  # greedy all the same, but not the kept Request's options
        )
        conversation = rendered("user: hello", f"assistant: {first.output_text}", "user: again")
        assert second.output_text == greedy_text(conversation, 5)
        shared = len(rendered("user: hello")) + 5 - 1  # what the closed Request had computed
        assert second.usage.input_tokens_details.cached_tokens == shared // BLOCK * BLOCK
        metrics = settled_metrics(live)
        assert metric(metrics, "pagedgen:num_turns_resumed_total", model_name="synthetic") == 0
        assert metric(metrics, "pagedgen:num_requests_kept", model_name="synthetic") == 1  # second's
    finally:
        live.stop()


def test_a_constrained_turn_does_not_constrain_its_resumed_follow_up():
    """The kept Request was created with the first turn's schema; the follow-up asks for plain text."""
    live = _serve()
    try:
        client = client_of(live)
        schema = {
            "type": "object",
            "properties": {"a": {"type": "boolean"}},
            "required": ["a"],
            "additionalProperties": False,
        }
        first = create(
            client,
            input="json",
            text={"format": {"type": "json_schema", "name": "s", "schema": schema}},
            max_output_tokens=40,
        )
        assert first.status == "completed" and json.loads(first.output_text) in ({"a": True}, {"a": False})
        second = create(client, input="free", previous_response_id=first.id, max_output_tokens=6)
        conversation = rendered("user: json", f"assistant: {first.output_text}", "user: free")
        assert second.output_text == greedy_text(conversation, 6)
        assert metric(settled_metrics(live), "pagedgen:num_turns_resumed_total", model_name="synthetic") == 1
    finally:
        live.stop()


def test_store_false_stores_nothing_and_keeps_no_request():
    live = _serve()
    try:
        client = client_of(live)
        response = create(client, input="hello", max_output_tokens=3, store=False)
        assert response.output_text == greedy_text(rendered("user: hello"), 3)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(response.id)
        assert metric(settled_metrics(live), "pagedgen:num_requests_kept", model_name="synthetic") == 0
        assert len(app_state(live).response_store) == 0
    finally:
        live.stop()


def test_a_missing_previous_response_is_a_404_naming_the_field(client):
    with pytest.raises(openai.NotFoundError) as caught:
        create(client, input="x", previous_response_id="resp_nope")
    error = caught.value.body
    assert error["param"] == "previous_response_id" and error["code"] == "response_not_found"
    assert "resp_nope" in error["message"] and error["type"] == "invalid_request_error"


def test_retrieve_and_delete(client):
    response = create(client, input="keep me", max_output_tokens=3)
    assert client.responses.retrieve(response.id).output_text == response.output_text
    deleted = httpx.delete(f"{client.base_url}responses/{response.id}", timeout=60)
    assert deleted.status_code == 200 and deleted.json() == {
        "id": response.id,
        "object": "response.deleted",
        "deleted": True,
    }
    for call in (
        lambda: client.responses.retrieve(response.id),
        lambda: client.responses.delete(response.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()


def test_the_store_is_bounded_and_evicts_the_least_recently_used():
    live = _serve(response_store=StoreLimits(max_responses=2))
    try:
        client = client_of(live)
        a, b = (create(client, input=text, max_output_tokens=2) for text in ("a", "b"))
        client.responses.retrieve(a.id)  # a is now more recently used than b
        c = create(client, input="c", max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            create(client, input="x", previous_response_id=b.id)
        assert {client.responses.retrieve(r.id).id for r in (a, c)} == {a.id, c.id}
        # b's open Request was closed with it: two kept, one per stored response.
        assert metric(settled_metrics(live), "pagedgen:num_requests_kept", model_name="synthetic") == 2
    finally:
        live.stop()
    live = _serve(response_store=StoreLimits(max_bytes=400))  # smaller than any response
    try:
        client = client_of(live)
        response = create(client, input="a", max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(response.id)
        assert metric(settled_metrics(live), "pagedgen:num_requests_kept", model_name="synthetic") == 0
    finally:
        live.stop()


def test_the_worker_keeps_a_bounded_number_of_requests(monkeypatch):
    """Past the bound the least recently kept Request is closed; its response stays stored, and its
    follow-up runs in a fresh Request that finds the closed one's full blocks in the prefix cache."""
    monkeypatch.setattr(worker_module, "MAX_KEPT_REQUESTS", 1)
    live = _serve()
    try:
        client = client_of(live)
        a = create(client, input="hello", max_output_tokens=5)
        b = create(client, input="other", max_output_tokens=5)
        assert metric(settled_metrics(live), "pagedgen:num_requests_kept", model_name="synthetic") == 1
        follow = create(client, input="again", previous_response_id=a.id, max_output_tokens=5)
        conversation = rendered("user: hello", f"assistant: {a.output_text}", "user: again")
        assert follow.output_text == greedy_text(conversation, 5)
        computed = len(rendered("user: hello")) + 5 - 1
        assert follow.usage.input_tokens_details.cached_tokens == computed // BLOCK * BLOCK
        resumed = create(client, input="more", previous_response_id=follow.id, max_output_tokens=5)
        assert resumed.usage.input_tokens_details.cached_tokens == follow.usage.total_tokens - 1
        metrics = settled_metrics(live)
        assert metric(metrics, "pagedgen:num_turns_resumed_total", model_name="synthetic") == 1
        assert client.responses.retrieve(b.id).output_text == b.output_text
    finally:
        live.stop()


BAD = [
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input[0].content[0].type",
    ),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input[0].type"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "background": True}, "background"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    (
        {"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "nope"}}}},
        "text.format.schema",
    ),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    (
        {"input": "x", "tools": [{**WEATHER, "parameters": {"type": "bogus"}}], "tool_choice": "required"},
        "tools[0].parameters",
    ),
    ({"input": "x", "tools": [{**WEATHER, "name": "bad name"}], "tool_choice": "required"}, "tools[0].name"),
]


@pytest.mark.parametrize(("fields", "param"), BAD)
def test_bad_input_is_a_400_naming_the_field(server, fields, param):
    reply = httpx.post(server.url + "/v1/responses", json={"model": "synthetic", **fields}, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"]
