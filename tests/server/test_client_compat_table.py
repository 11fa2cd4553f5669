"""The table of what clients coming from vLLM, llama.cpp's server or ollama send, re-run with the ``openai``
client: one test per row, each asserting that the row works or is the documented, deliberate refusal.

Rows, as the table in docs/server.md ("Clients people already use: the table re-run") lists them:

1. ``tools`` with ``tool_choice: "auto"`` or without ``tool_choice``: the reply carries ``tool_calls``.
2. fields pagedgen does not implement (``store``, ``metadata``, ...) and vLLM's extras
   (``chat_template_kwargs``, ``skip_special_tokens``, ``add_generation_prompt``, ``continue_final_message``):
   ignored and logged, or honoured; a bad value of a known field is a 400 naming it.
3. ``n=2``, ``prompt`` as a list, ``echo=true``.
4. ``/tokenize``, ``/detokenize``, ``/v1/models/{id}``, ``/version``; and (its own test) ``/v1/responses``.
5. a reasoning model's ``<think>...</think>``: ``reasoning_content``.
6. a browser front-end on another origin: CORS with ``--allowed-origins``.

Everything runs on synthetic-model servers (exact text: the synthetic greedy formula, or a scripted reply
for the rows where the model must write tags), bound to 127.0.0.1.
"""

from __future__ import annotations

import json
import logging
import uuid

import httpx
import jsonschema
import openai
import pytest

import pagedgen as pg
from pagedgen import cli
from pagedgen.models.synthetic import SyntheticModel, SyntheticTokenizer, synthetic_greedy
from pagedgen.server.app import ServerOptions, build_app
from tests.server.doubles import VOCAB, TableTemplate, client_of, serve
from tests.server.doubles import ScriptedModel as ToolScriptedModel
from tests.server.live import LiveServer
from tests.server.reasoning_doubles import EOS, ScriptedModel, script_reply

KEY = "table-key"
ORIGIN = "http://localhost:3000"
CHAT = [{"role": "user", "content": "Hi"}]
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "pick", "description": "pick an answer", "parameters": SCHEMA},
    }
]


def greedy(prompt: str, max_tokens: int) -> str:
    codec = SyntheticTokenizer(VOCAB)
    return codec.decode(synthetic_greedy(codec.encode(prompt), max_tokens, VOCAB))


@pytest.fixture(scope="module")
def server():
    """The synthetic model behind an API key, with one allowed origin."""
    template = TableTemplate()
    live = serve(SyntheticModel(vocab_size=VOCAB), tokenizer=template, api_key=KEY, allowed_origins=(ORIGIN,))
    live.template = template
    yield live
    live.stop()


@pytest.fixture(scope="module")
def api(server):
    return client_of(server, KEY)


def scripted_server(options: ServerOptions) -> tuple[LiveServer, ScriptedModel, TableTemplate]:
    model = ScriptedModel(vocab_size=VOCAB, eos_token_id=EOS)
    template = TableTemplate(EOS)
    config = pg.EngineConfig(max_batch_size=4, num_blocks=64, debug_invariants=True)
    return LiveServer(build_app(model, config, options, tokenizer=template)).start(), model, template


def serve_options(*flags: str) -> ServerOptions:
    """The server options ``pagedgen serve FLAGS`` would run with (the flags are the command line's)."""
    args = cli.build_parser().parse_args(["serve", "--served-model-name", "synthetic", *flags])
    return cli.server_options(args)


# ---------------------------------------------------------------- row 1: automatic tool calls


def test_row_1_tools_without_tool_choice_or_auto_answer_tool_calls():
    call = '<tool_call>\n{"name": "pick", "arguments": {"answer": "yes"}}\n</tool_call>'
    model = ToolScriptedModel({"Hi": call, "Say it": "Just text."})  # a codec with newlines, as hermes writes
    config = pg.EngineConfig(max_batch_size=4, num_blocks=64, debug_invariants=True)
    options = serve_options("--tool-call-parser", "hermes")
    live = LiveServer(build_app(model, config, options, tokenizer=model.codec)).start()
    try:
        api = client_of(live)
        for choice in ({}, {"tool_choice": "auto"}):
            response = api.chat.completions.create(
                model="synthetic", messages=CHAT, tools=TOOLS, temperature=0, max_tokens=80, **choice
            )
            assert model.codec.seen_tools[-1] == TOOLS  # the tools reached the chat template
            (made,) = response.choices[0].message.tool_calls
            assert (made.function.name, json.loads(made.function.arguments)) == ("pick", {"answer": "yes"})
            assert not response.choices[0].message.content
            assert response.choices[0].finish_reason == "tool_calls"
            stream = api.chat.completions.create(
                model="synthetic",
                messages=CHAT,
                tools=TOOLS,
                temperature=0,
                max_tokens=80,
                stream=True,
                **choice,
            )
            names, arguments, finish = [], [], None
            for chunk in stream:
                for delta in chunk.choices[0].delta.tool_calls or []:
                    names.append(delta.function.name or "")
                    arguments.append(delta.function.arguments or "")
                finish = chunk.choices[0].finish_reason or finish
            assert ("".join(names), json.loads("".join(arguments)), finish) == (
                "pick",
                {"answer": "yes"},
                "tool_calls",
            )
        text = [{"role": "user", "content": "Say it"}]  # the model may answer in text
        response = api.chat.completions.create(
            model="synthetic", messages=text, tools=TOOLS, temperature=0, max_tokens=40
        )
        assert response.choices[0].message.content == "Just text."
        assert not response.choices[0].message.tool_calls
        assert response.choices[0].finish_reason == "stop"
    finally:
        live.stop()


# ---------------------------------------------------------------- row 2: fields pagedgen does not know


def test_row_2_unknown_fields_are_ignored_and_vllm_extras_honoured(server, api, caplog):
    plain = api.chat.completions.create(model="synthetic", messages=CHAT, max_tokens=5, temperature=0)
    prompt = "user: Hi|assistant: "
    assert plain.choices[0].message.content == greedy(prompt, 5)
    novel = f"x_{uuid.uuid4().hex[:8]}"
    with caplog.at_level(logging.WARNING, logger="pagedgen.server"):
        extra = api.chat.completions.create(
            model="synthetic",
            messages=CHAT,
            max_tokens=5,
            temperature=0,
            store=True,
            metadata={"session": "s1"},
            service_tier="auto",
            reasoning_effort="high",
            modalities=["text"],
            user="user-1234",
            extra_body={novel: 1},
        )
    assert extra.choices[0].message.content == plain.choices[0].message.content
    assert any(novel in record.getMessage() and "ignored" in record.getMessage() for record in caplog.records)

    def chat(**extra_body):
        return api.chat.completions.create(
            model="synthetic", messages=CHAT, max_tokens=4, temperature=0, extra_body=extra_body
        )

    thinking_off = chat(chat_template_kwargs={"enable_thinking": False})
    assert server.template.seen[-1]["enable_thinking"] is False
    assert thinking_off.usage.prompt_tokens == len("/no_think " + prompt)
    assert chat(skip_special_tokens=False).choices[0].message.content == greedy(prompt, 4)
    unopened = chat(add_generation_prompt=False)
    assert unopened.usage.prompt_tokens == len("user: Hi|")
    messages = [*CHAT, {"role": "assistant", "content": "Once upon"}]
    continued = api.chat.completions.create(
        model="synthetic",
        messages=messages,
        max_tokens=4,
        temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert continued.choices[0].message.content == greedy("user: Hi|assistant: Once upon", 4)
    assert (
        api.chat.completions.create(
            model="synthetic", messages=CHAT, max_completion_tokens=3, temperature=0
        ).usage.completion_tokens
        == 3
    )

    NAMED = {"name": "a", "schema": SCHEMA}
    bad = [
        ({"user": 5}, "user"),
        ({"temperature": "hot"}, "temperature"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_completion_tokens": "3"}, "max_completion_tokens"),
        ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
        ({"max_completion_tokens": 10**9}, "max_completion_tokens"),
        ({"skip_special_tokens": 1}, "skip_special_tokens"),
        ({"add_generation_prompt": "false"}, "add_generation_prompt"),
        ({"continue_final_message": 1}, "continue_final_message"),
        ({"continue_final_message": True}, "continue_final_message"),  # with the generation prompt
        ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"depth": [1]}}, "chat_template_kwargs.depth"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
        ({"response_format": {"type": "json_schema", "json_schema": NAMED, "strictly": 1}},
         "response_format.strictly"),
    ]  # fmt: skip
    for fields, param in bad:
        with pytest.raises(openai.BadRequestError) as info:
            api.chat.completions.create(model="synthetic", messages=CHAT, extra_body=fields)
        assert info.value.body["param"] == param, (fields, info.value.body)
    completion_bad = [
        ({"user": 5}, "user"),
        ({"echo": "yes"}, "echo"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": [[1, 2], [10**6]]}, "prompt[1]"),  # outside the vocabulary
        ({"max_tokens": 10**9}, "max_tokens"),
    ]
    for fields, param in completion_bad:
        body = {"prompt": "ab", **fields}
        with pytest.raises(openai.BadRequestError) as info:
            api.completions.create(model="synthetic", prompt=body.pop("prompt"), extra_body=body)
        assert info.value.body["param"] == param, (fields, info.value.body)


# ---------------------------------------------------------------- row 3: n, prompt lists, echo


def test_row_3_n_choices_prompt_lists_and_echo(api):
    prompt = "user: Hi|assistant: "
    two = api.chat.completions.create(model="synthetic", messages=CHAT, n=2, max_tokens=6, temperature=0)
    assert [c.index for c in two.choices] == [0, 1]
    assert [c.message.content for c in two.choices] == [greedy(prompt, 6)] * 2
    assert (two.usage.prompt_tokens, two.usage.completion_tokens) == (len(prompt), 12)
    stream = api.chat.completions.create(
        model="synthetic", messages=CHAT, n=2, max_tokens=6, temperature=0, stream=True
    )
    texts = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {0: greedy(prompt, 6), 1: greedy(prompt, 6)}

    batch = api.completions.create(
        model="synthetic", prompt=["The sky is", "Two plus"], max_tokens=5, temperature=0
    )
    assert [c.text for c in batch.choices] == [greedy("The sky is", 5), greedy("Two plus", 5)]
    ids = SyntheticTokenizer(VOCAB).encode("abc")
    by_ids = api.completions.create(model="synthetic", prompt=[ids, ids], max_tokens=3, temperature=0)
    assert [c.text for c in by_ids.choices] == [greedy("abc", 3)] * 2
    echoed = api.completions.create(
        model="synthetic", prompt="The sky is", max_tokens=5, temperature=0, echo=True
    )
    assert echoed.choices[0].text == "The sky is" + greedy("The sky is", 5)

    refusals = [  # documented: a batch is not streamed; echo would need the prompt's logprobs
        ({"prompt": ["a", "b"], "stream": True}, "stream"),
        ({"prompt": "a", "echo": True, "logprobs": 1}, "echo"),
    ]
    for fields, param in refusals:
        with pytest.raises(openai.BadRequestError) as info:
            api.completions.create(model="synthetic", max_tokens=2, **fields)
        assert info.value.body["param"] == param


# ---------------------------------------------------------------- row 4: the routes clients probe


def test_row_4_tokenize_detokenize_models_and_version(server, api):
    headers = {"Authorization": f"Bearer {KEY}"}
    chat = api.chat.completions.create(model="synthetic", messages=CHAT, max_tokens=1)
    counted = httpx.post(
        server.url + "/tokenize", json={"model": "synthetic", "messages": CHAT}, headers=headers
    )
    assert counted.status_code == 200 and counted.json()["count"] == chat.usage.prompt_tokens
    tokens = counted.json()["tokens"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": tokens}, headers=headers).json()["prompt"]
    assert text == "user: Hi|assistant: "
    assert api.models.retrieve("synthetic").id == "synthetic"
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("gpt-4o")
    version = httpx.get(server.url + "/version", headers=headers)
    assert version.json() == {"version": pg.__version__}


def test_row_4_the_responses_api(api):
    chat = api.chat.completions.create(model="synthetic", messages=CHAT, max_tokens=6, temperature=0)
    first = api.responses.create(model="synthetic", input="Hi", max_output_tokens=6, temperature=0)
    assert first.output_text == chat.choices[0].message.content
    events = list(
        api.responses.create(model="synthetic", input="Hi", max_output_tokens=6, temperature=0, stream=True)
    )
    # max_output_tokens ends the answer: OpenAI's "incomplete" status, and its closing event
    assert (first.status, first.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert (events[0].type, events[-1].type) == ("response.created", "response.incomplete")
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == first.output_text
    follow = api.responses.create(
        model="synthetic", input="More", previous_response_id=first.id, max_output_tokens=4, temperature=0
    )
    assert 0 < follow.usage.input_tokens_details.cached_tokens <= follow.usage.input_tokens
    shaped = api.responses.create(
        model="synthetic",
        input="Hi",
        max_output_tokens=40,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}},
    )
    jsonschema.validate(json.loads(shaped.output_text), SCHEMA)
    with pytest.raises(openai.NotFoundError):
        api.responses.create(model="synthetic", input="x", previous_response_id="resp_missing")


# ---------------------------------------------------------------- row 5: reasoning


def test_row_5_reasoning_goes_to_reasoning_content():
    live, model, template = scripted_server(serve_options("--reasoning-parser", "qwen3"))
    try:
        api = client_of(live)
        script_reply(model, template, CHAT, "<think>The user greets me.</think>  Hello!")
        message = (
            api.chat.completions.create(model="synthetic", messages=CHAT, temperature=0).choices[0].message
        )
        assert message.content == "Hello!"
        assert (
            message.model_extra["reasoning_content"]
            == message.model_extra["reasoning"]
            == "The user greets me."
        )
        reasoning, content = "", ""
        for chunk in api.chat.completions.create(
            model="synthetic", messages=CHAT, temperature=0, stream=True
        ):
            delta = chunk.choices[0].delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
        assert (reasoning, content) == ("The user greets me.", "Hello!")
    finally:
        live.stop()


# ---------------------------------------------------------------- row 6: a browser page on another origin


def test_row_6_cors_for_the_allowed_origins_and_a_405_without_the_flag(server):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    answer = httpx.options(server.url + "/v1/chat/completions", headers=preflight)
    assert answer.status_code == 200
    assert answer.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(
        server.url + "/v1/chat/completions",
        headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    posted = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "synthetic", "messages": CHAT, "max_tokens": 2},
        headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"},
    )
    assert posted.status_code == 200 and posted.headers["access-control-allow-origin"] == ORIGIN
    closed = serve(SyntheticModel(vocab_size=VOCAB))  # documented: without --allowed-origins, no CORS
    try:
        refused = httpx.options(closed.url + "/v1/chat/completions", headers=preflight)
        assert refused.status_code == 405 and "access-control-allow-origin" not in refused.headers
    finally:
        closed.stop()


def test_row_5_reasoning_on_the_responses_api_is_a_reasoning_item():
    live, model, template = scripted_server(serve_options("--reasoning-parser", "qwen3"))
    try:
        api = client_of(live)
        script_reply(model, template, CHAT, "<think>The user greets me.</think>  Hello!")
        response = api.responses.create(model="synthetic", input="Hi", temperature=0)
        assert [item.type for item in response.output] == ["reasoning", "message"]
        assert response.output[0].content[0].text == "The user greets me."
        assert response.output_text == "Hello!"
    finally:
        live.stop()


def test_rows_1_and_5_an_automatic_tool_call_after_the_reasoning():
    call = '<tool_call>\n{"name": "pick", "arguments": {"answer": "no"}}\n</tool_call>'
    model = ToolScriptedModel({"Hi": f"<think>Pick one.</think>\n{call}"})
    config = pg.EngineConfig(max_batch_size=4, num_blocks=64, debug_invariants=True)
    options = serve_options("--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
    live = LiveServer(build_app(model, config, options, tokenizer=model.codec)).start()
    try:
        response = client_of(live).chat.completions.create(
            model="synthetic", messages=CHAT, tools=TOOLS, temperature=0, max_tokens=120
        )
        message = response.choices[0].message
        assert message.model_extra["reasoning_content"] == "Pick one."
        (made,) = message.tool_calls
        assert (made.function.name, json.loads(made.function.arguments)) == ("pick", {"answer": "no"})
        assert response.choices[0].finish_reason == "tool_calls"
    finally:
        live.stop()
