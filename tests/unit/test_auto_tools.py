"""``tool_choice: "auto"``: the plan of a request (format, prompt, decoding) and the constraint it runs under.

The constraint is checked with llguidance itself, one character a token (the scripted model's codec, with
newline and EOS): text before a call is never constrained, and a call, once opened, must name a tool and
carry arguments valid for its schema, in the format's exact layout.
"""

from __future__ import annotations

import llguidance
import pytest

from pagedgen.guidance.spec import compile_guidance
from pagedgen.guidance.tokenizer import guidance_tokenizer
from pagedgen.server.auto_tools import AutoToolSettings, auto_tool_calls, renders_tools
from pagedgen.server.guard import ApiError
from pagedgen.server.protocol import ChatCompletionRequest
from pagedgen.server.tool_parsers import FORMATS, tool_call_grammar
from tests.server.doubles import LineTokenizer, ScriptedModel

PICK = {
    "type": "object",
    "properties": {"side": {"enum": ["left", "right"]}},
    "required": ["side"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "pick", "parameters": PICK}},
    {"type": "function", "function": {"name": "ping"}},
]
PAIRS = [("pick", PICK), ("ping", {"type": "object", "properties": {}, "additionalProperties": False})]
MODEL = ScriptedModel({})
CODEC = LineTokenizer()


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS, **fields}
    )


class TemplateTokenizer:
    """A tokenizer with chat template text and special tokens: ``specials`` maps their text to ids."""

    def __init__(self, template: str, specials: dict[str, int] | None = None):
        self.chat_template = template
        self.specials = specials or {}

    def encode(self, text: str, add_special_tokens: bool = False, *, parse_special: bool = True) -> list[int]:
        if parse_special and text in self.specials:
            return [self.specials[text]]
        return [ord(ch) for ch in text]

    def render_chat(self, *args, **kwargs):  # pragma: no cover - only its presence matters here
        raise AssertionError


# ---------------------------------------------------------------- the plan


@pytest.mark.parametrize(
    ("template", "parser", "name", "fallback"),
    [
        (None, None, "hermes", True),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", None, "hermes", True),
        ("{{ tools | tojson }} <tool_call>", None, "hermes", False),
        ("{% for m in messages %}{% break %}{% endfor %}{{ tools }}[TOOL_CALLS]", None, "mistral", False),
        ("{% if tools %}{{ tools }}<|python_tag|>{% endif %}", None, "llama3_json", False),
        ("{{ tools }}<tool_call>", "llama3_json", "llama3_json", False),
        (None, "mistral", "mistral", True),
    ],
)
def test_the_format_comes_from_the_flag_else_the_template(template, parser, name, fallback):
    tokenizer = CODEC if template is None else TemplateTokenizer(template)
    request = chat()
    plan = auto_tool_calls(request, tokenizer, AutoToolSettings(parser=parser))
    assert plan is not None and plan.format.name == name
    assert (plan.system_prompt is not None) == fallback
    assert request.constraint_param == "tools"
    assert request.structured_outputs_params().grammar == plan.grammar
    assert request.skip_special_tokens and not plan.keep_special_tokens


def test_a_template_with_tools_in_an_unknown_format_asks_for_the_flag():
    with pytest.raises(ApiError) as info:
        auto_tool_calls(chat(), TemplateTokenizer("{{ tools }} <function=f>"), AutoToolSettings())
    assert info.value.status == 400 and info.value.param == "tool_choice"
    assert "--tool-call-parser" in info.value.message


def test_auto_off_is_a_400_and_other_tool_choices_need_no_plan():
    with pytest.raises(ApiError) as info:
        auto_tool_calls(chat(tool_choice="auto"), CODEC, AutoToolSettings(enabled=False))
    assert info.value.status == 400 and info.value.param == "tool_choice"
    for fields in ({"tool_choice": "none"}, {"tool_choice": "required"}, {"tools": None},
                   {"tool_choice": {"type": "function", "function": {"name": "pick"}}}):  # fmt: skip
        assert auto_tool_calls(chat(**fields), CODEC, AutoToolSettings(enabled=False)) is None
    with pytest.raises(ValueError, match="tool_call_parser"):
        AutoToolSettings(parser="qwen")


def test_a_special_token_trigger_is_matched_as_its_token_and_kept_in_the_text():
    tokenizer = TemplateTokenizer("{{ tools }}[TOOL_CALLS]", {"[TOOL_CALLS]": 7})
    request = chat()
    plan = auto_tool_calls(request, tokenizer, AutoToolSettings())
    assert plan.keep_special_tokens and "<[7]>" in plan.grammar and "[TOOL_CALLS]" not in plan.grammar
    assert request.skip_special_tokens is False


def test_the_fallback_prompt_joins_the_system_message_or_comes_first():
    plan = auto_tool_calls(chat(), CODEC, AutoToolSettings())
    user = {"role": "user", "content": "Hi"}
    (system, rest) = plan.prompt_messages([user])
    assert system == {"role": "system", "content": plan.system_prompt} and rest == user
    joined = plan.prompt_messages([{"role": "system", "content": "Be brief."}, user])
    assert joined[0]["content"] == f"Be brief.\n\n{plan.system_prompt}" and joined[1] == user


def test_renders_tools_reads_the_template_variables():
    assert renders_tools("{% for t in tools %}{{ t }}{% endfor %}")
    assert not renders_tools("{% set tools = [] %}{{ tools }}")  # assigned by the template itself
    assert not renders_tools("{{ messages }}") and not renders_tools("") and not renders_tools("{% if %}")


# ---------------------------------------------------------------- the constraint


def matcher(fmt: str, parallel: bool = True) -> llguidance.LLMatcher:
    grammar = tool_call_grammar(FORMATS[fmt], PAIRS, parallel, None)
    spec = compile_guidance("lark_grammar", grammar)
    return llguidance.LLMatcher(guidance_tokenizer(MODEL), spec.grammar, log_level=0)


def accepts(fmt: str, text: str, parallel: bool = True) -> bool:
    """Whether the constraint lets the model write ``text`` and then end the reply."""
    m = matcher(fmt, parallel)
    for token in CODEC.encode(text):
        if not m.consume_token(token):
            return False
    return m.is_accepting()


def allowed(m: llguidance.LLMatcher) -> int:
    return int.from_bytes(m.compute_bitmask(), "little").bit_count()


HERMES_CALL = '<tool_call>\n{"name": "pick", "arguments": {"side": "left"}}\n</tool_call>'
PING = '\n<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
LLAMA_TWO = '{"name": "pick", "parameters": {"side": "right"}}; {"name": "ping", "parameters": {}}'
MISTRAL_TWO = '[TOOL_CALLS] [{"name": "ping", "arguments": {}}, {"name": "ping", "arguments": {}}]'


@pytest.mark.parametrize(
    ("fmt", "text", "parallel", "ok"),
    [
        ("hermes", "", True, True),
        ("hermes", "Any text: {braces}, <tags>, <tool and\nnewlines.", True, True),
        ("hermes", "Sure.\n" + HERMES_CALL, True, True),
        ("hermes", HERMES_CALL + PING, True, True),
        ("hermes", HERMES_CALL + PING, False, False),
        ("hermes", HERMES_CALL + " and text after it", True, False),
        ("hermes", '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>', True, False),
        ("hermes", '<tool_call>\n{"name": "pick", "arguments": {"side": "middle"}}\n</tool_call>', True,
         False),
        ("hermes", '<tool_call>\n{"name": "pick", "arguments": {"side": "left", "x": 1}}\n</tool_call>', True,
         False),
        ("hermes", '<tool_call>\n{"name": "pick", "arguments": {"side": "left"}', True, False),  # unfinished
        ("llama3_json", '{"name": "pick", "parameters": {"side": "right"}}', True, True),
        ("llama3_json", LLAMA_TWO,
         True, True),
        ("llama3_json", LLAMA_TWO,
         False, False),
        ("llama3_json", "The set {1, 2} has two elements.", True, True),
        ("llama3_json", '{"not": "a call"}', True, False),
        ("mistral", 'Ok [TOOL_CALLS] [{"name": "ping", "arguments": {}}, {"name": "pick", "arguments": '
         '{"side": "left"}}]', True, True),
        ("mistral", MISTRAL_TWO, False,
         False),
        ("mistral", "A list [1, 2] and no call", True, True),
    ],
)  # fmt: skip
def test_the_constraint_frees_text_and_forces_valid_calls(fmt, text, parallel, ok):
    assert accepts(fmt, text, parallel) == ok


def test_text_is_unconstrained_until_the_trigger_then_every_character_is_the_calls():
    m = matcher("hermes")
    assert allowed(m) == LineTokenizer.VOCAB  # every character, and EOS
    for token in CODEC.encode("Let me see <tool"):
        assert m.consume_token(token)
        assert allowed(m) == LineTokenizer.VOCAB
    for token in CODEC.encode('_call>\n{"name": "p'):
        assert m.consume_token(token)
    assert allowed(m) == 1  # "pick" and "ping" share "pi"
    for token in CODEC.encode("i"):
        assert m.consume_token(token)
    assert allowed(m) == 2  # ... then differ
