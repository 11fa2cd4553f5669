"""``--reasoning-parser`` through the HTTP server, with the real ``openai`` client, on a scripted model.

The scripted model answers a fixed text (:mod:`tests.server.reasoning_doubles`), so every reasoning and
content string is checked exactly, streamed and not. With a JSON schema (or a forced tool call) the
script's answer after ``</think>`` is not JSON: the reasoning still comes back exactly as scripted (it
was not constrained) and the content is the schema's (it was), so the constraint applies after the
reasoning and only there.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

import pagedgen as pg
from pagedgen import cli
from pagedgen.server.app import ServerOptions, build_app
from tests.server.doubles import client_of
from tests.server.live import LiveServer
from tests.server.reasoning_doubles import EOS, VOCAB, ScriptedModel, ThinkingTemplate, script_reply

CHAT = [{"role": "user", "content": "Hi"}]
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}


class Scripted:
    """A live server of a scripted model; :meth:`reply` sets the script for the next request."""

    def __init__(self, parser: str | None, opens_thinking: bool):
        self.model = ScriptedModel(vocab_size=VOCAB, eos_token_id=EOS)
        self.template = ThinkingTemplate(opens_thinking)
        config = pg.EngineConfig(max_batch_size=4, num_blocks=64, debug_invariants=True)
        options = ServerOptions(model_name="synthetic", reasoning_parser=parser)
        self.live = LiveServer(build_app(self.model, config, options, tokenizer=self.template)).start()
        self.api = client_of(self.live)

    def reply(self, text: str, **variables) -> None:
        script_reply(self.model, self.template, CHAT, text, **variables)

    def stop(self) -> None:
        self.live.stop()


@pytest.fixture(scope="module")
def r1():
    """DeepSeek-R1's convention, with a template that opens ``<think>`` in the prompt."""
    server = Scripted("deepseek_r1", opens_thinking=True)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def qwen3():
    server = Scripted("qwen3", opens_thinking=False)
    yield server
    server.stop()


def create(server: Scripted, **fields):
    return server.api.chat.completions.create(model="synthetic", messages=CHAT, temperature=0, **fields)


def stream_parts(server: Scripted, **fields) -> tuple[str, str, list, str | None]:
    """(reasoning, content, deltas, finish reason) of a stream; each reasoning delta carries both names."""
    reasoning, content, deltas, finish = [], [], [], None
    for chunk in create(server, stream=True, **fields):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        deltas.append(delta)
        extra = delta.model_extra or {}
        if extra.get("reasoning_content") is not None:
            assert extra["reasoning"] == extra["reasoning_content"]
            reasoning.append(extra["reasoning_content"])
        content.append(delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
    return "".join(reasoning), "".join(content), deltas, finish


def reasoning_of(message) -> str | None:
    extra = message.model_extra or {}
    assert extra["reasoning"] == extra["reasoning_content"]
    return extra["reasoning_content"]


def test_the_reply_splits_into_reasoning_and_content(r1):
    r1.reply("Two and two make four.</think>  Four.")
    message = create(r1).choices[0].message
    assert reasoning_of(message) == "Two and two make four."
    assert message.content == "Four."


def test_streamed_the_reasoning_comes_as_deltas_and_no_delta_holds_a_tag(r1):
    r1.reply("Two and two make four.</think>  Four.")
    reasoning, content, deltas, finish = stream_parts(r1)
    assert (reasoning, content, finish) == ("Two and two make four.", "Four.", "stop")
    assert len([d for d in deltas if (d.model_extra or {}).get("reasoning")]) > 10  # streamed, not at the end
    assert not any("<" in (d.content or "") + ((d.model_extra or {}).get("reasoning") or "") for d in deltas)


def test_a_reply_cut_before_the_end_tag_is_all_reasoning(r1):
    r1.reply("Still thinking about it</think> done")
    response = create(r1, max_tokens=8)
    assert reasoning_of(response.choices[0].message) == "Still th"
    assert response.choices[0].message.content is None
    assert response.choices[0].finish_reason == "length"


def test_a_json_schema_applies_after_the_reasoning(r1):
    r1.reply('I\'d say {maybe}, or "yes".</think>  Hello there, not JSON.')
    message = create(r1, response_format=JSON_FORMAT, max_tokens=80).choices[0].message
    assert reasoning_of(message) == 'I\'d say {maybe}, or "yes".'  # free text: not constrained
    jsonschema.validate(json.loads(message.content), SCHEMA)
    assert message.content == '{"answer": "no"}'  # "n" is the lowest token the schema allows there
    reasoning, content, _deltas, finish = stream_parts(r1, response_format=JSON_FORMAT, max_tokens=80)
    assert (reasoning, content, finish) == ('I\'d say {maybe}, or "yes".', '{"answer": "no"}', "stop")


def test_structured_outputs_and_parse_after_the_reasoning(r1):
    from pydantic import BaseModel

    class Answer(BaseModel):
        answer: str

    r1.reply('Thinking.</think>{"answer": "yes"}')
    parsed = r1.api.chat.completions.parse(
        model="synthetic", messages=CHAT, temperature=0, response_format=Answer, max_tokens=80
    )
    assert parsed.choices[0].message.parsed == Answer(answer="yes")
    r1.reply("Pick one.</think> b")
    message = create(r1, extra_body={"structured_outputs": {"choice": ["left", "right"]}}).choices[0].message
    assert (reasoning_of(message), message.content) == ("Pick one.", "left")


def test_a_forced_tool_call_applies_after_the_reasoning(r1):
    tools = [{"type": "function", "function": {"name": "pick", "parameters": SCHEMA}}]
    choice = {"type": "function", "function": {"name": "pick"}}
    r1.reply("I will call pick.</think> sure!")
    message = create(r1, tools=tools, tool_choice=choice, max_tokens=80).choices[0].message
    assert reasoning_of(message) == "I will call pick."
    (call,) = message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("pick", {"answer": "no"})
    reasoning, _content, deltas, _finish = stream_parts(r1, tools=tools, tool_choice=choice, max_tokens=80)
    arguments = "".join(
        call.function.arguments or "" for delta in deltas for call in (delta.tool_calls or [])
    )
    assert (reasoning, json.loads(arguments)) == ("I will call pick.", {"answer": "no"})


def test_n_choices_each_split(r1):
    r1.reply("Hm.</think>Yes.")
    response = create(r1, n=2)
    assert [(reasoning_of(c.message), c.message.content) for c in response.choices] == [("Hm.", "Yes.")] * 2


def test_qwen3_reasons_when_the_reply_opens_think_and_not_otherwise(qwen3):
    qwen3.reply("<think>Short.</think>  Hello.")
    message = create(qwen3).choices[0].message
    assert (reasoning_of(message), message.content) == ("Short.", "Hello.")
    qwen3.reply("Hello, no thinking.")
    message = create(qwen3).choices[0].message
    assert (reasoning_of(message), message.content) == (None, "Hello, no thinking.")


def test_qwen3_enable_thinking_false_is_all_content(qwen3):
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    qwen3.reply("<think>a</think>b", enable_thinking=False)
    message = create(qwen3, extra_body=kwargs).choices[0].message
    assert (reasoning_of(message), message.content) == (None, "<think>a</think>b")
    qwen3.reply("Not JSON", enable_thinking=False)  # a constraint then applies from the first token
    message = create(qwen3, extra_body=kwargs, response_format=JSON_FORMAT, max_tokens=40).choices[0].message
    assert message.content == '{"answer": "no"}'


def test_qwen3_json_schema_with_an_optional_reasoning_block(qwen3):
    qwen3.reply("<think>Let me see {x}.</think> whatever")
    message = create(qwen3, response_format=JSON_FORMAT, max_tokens=80).choices[0].message
    assert (reasoning_of(message), message.content) == ("Let me see {x}.", '{"answer": "no"}')


def test_without_a_parser_the_tags_stay_in_the_content():
    server = Scripted(None, opens_thinking=False)
    try:
        server.reply("<think>a</think>b")
        message = create(server).choices[0].message
        assert message.content == "<think>a</think>b"
        assert "reasoning_content" not in (message.model_extra or {})
    finally:
        server.stop()


def test_an_unknown_parser_is_one_line_and_status_2(capsys, monkeypatch):
    monkeypatch.delenv("PAGEDGEN_API_KEY", raising=False)
    assert cli.main(["serve", "--reasoning-parser", "r1", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "pagedgen serve: error: --reasoning-parser: unknown reasoning parser 'r1': "
        "choose one of deepseek_r1, qwen3, think\n"
    )
    args = cli.build_parser().parse_args(["serve", "--reasoning-parser", "qwen3"])
    assert cli.server_options(args).reasoning_parser == "qwen3"
    assert cli.server_options(cli.build_parser().parse_args(["serve"])).reasoning_parser is None
    with pytest.raises(ValueError, match="unknown reasoning parser 'x'"):
        ServerOptions(reasoning_parser="x")


# ---------------------------------------------------------------- the default model's BPE vocabulary


@pytest.mark.model
def test_the_grammar_takes_bpe_tokens_that_split_or_straddle_the_tag(default_model):
    """On a real vocabulary the tag is several tokens, and one token may hold its end and what follows."""
    import llguidance

    from pagedgen.guidance.spec import parser_limits
    from pagedgen.guidance.tokenizer import guidance_tokenizer
    from pagedgen.llm import SamplingParams, StructuredOutputsParams, tokenizer_for
    from pagedgen.server.reasoning import REASONING_PARSERS, ReasoningStart, constrain_after_reasoning

    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    grammar = constrain_after_reasoning(
        params, REASONING_PARSERS["deepseek_r1"], ReasoningStart.REASONING
    ).structured_outputs.grammar
    tokenizer = tokenizer_for(default_model)
    for text in ['Hmm, {"answer"}?</think>\n\n{"answer": "yes"}', 'ok</think>{"answer": "no"}']:
        ids = tokenizer.encode(text, parse_special=False)
        pieces = [tokenizer.decode([t]) for t in ids]
        assert "</think>" not in pieces  # the tag is split over tokens
        matcher = llguidance.LLMatcher(guidance_tokenizer(default_model), grammar, limits=parser_limits())
        assert all(matcher.consume_token(t) for t in ids), matcher.get_error()
        assert matcher.is_accepting()


@pytest.mark.model
def test_the_default_model_answers_the_schema_with_an_optional_reasoning_block(default_model):
    config = pg.EngineConfig(max_batch_size=4, num_blocks=128, debug_invariants=True)
    options = ServerOptions(model_name="default", reasoning_parser="qwen3")
    live = LiveServer(build_app(default_model, config, options)).start()
    try:
        api = client_of(live)
        question = [{"role": "user", "content": "Is Paris in France? Answer in JSON."}]
        for stream in (False, True):
            fields = {"response_format": JSON_FORMAT, "max_tokens": 40, "temperature": 0}
            if stream:
                chunks = api.chat.completions.create(
                    model="default", messages=question, stream=True, **fields
                )
                content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            else:
                message = api.chat.completions.create(model="default", messages=question, **fields)
                message = message.choices[0].message
                assert reasoning_of(message) is None  # SmolLM2 does not open <think>
                content = message.content
            jsonschema.validate(json.loads(content), SCHEMA)
    finally:
        live.stop()
