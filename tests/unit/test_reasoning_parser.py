"""The reasoning parsers (``--reasoning-parser``) and the grammar that constrains only the answer after it.

Every case is checked on the whole text and streamed in every two- and three-piece split (so each tag is
split at every position, and pieces may hold a tag and text on both sides), plus hypothesis' random
splits: the streamed pieces must add up to exactly the whole text's split (deltas only add text, so no
piece can have sent a part of a tag it consumed). The grammar is checked with llguidance's matcher over
the synthetic codec (one token per character, so a tag is always split over tokens).
"""

from __future__ import annotations

import json

import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedgen.guidance.prefixed import constraint_after_text
from pagedgen.guidance.spec import parser_limits
from pagedgen.guidance.tokenizer import guidance_tokenizer
from pagedgen.llm import SamplingParams, StructuredOutputsParams
from pagedgen.models.synthetic import SyntheticModel
from pagedgen.server.reasoning import (
    REASONING_PARSERS,
    ReasoningDelta,
    ReasoningSplitter,
    ReasoningStart,
    constrain_after_reasoning,
    reasoning_parser,
    split_reasoning,
)

R1, QWEN3, THINK = (REASONING_PARSERS[name] for name in ("deepseek_r1", "qwen3", "think"))
REASONING, OPTIONAL, NONE = ReasoningStart.REASONING, ReasoningStart.OPTIONAL, ReasoningStart.NONE

# (parser, start, reply text, reasoning, content)
CASES = [
    (R1, REASONING, "Let me see.</think>\n\nParis.", "Let me see.", "Paris."),
    (R1, REASONING, "<think>\nLet me see.</think>Paris.", "\nLet me see.", "Paris."),
    (R1, REASONING, "  <think>a</think>b", "a", "b"),
    (R1, REASONING, "no end tag at all", "no end tag at all", ""),
    (R1, REASONING, "a</think>", "a", ""),
    (R1, REASONING, "a</think>b</think>c", "a", "b</think>c"),
    (R1, REASONING, "a</thin", "a</thin", ""),
    (R1, REASONING, "x <think> y</think>z", "x <think> y", "z"),
    (QWEN3, OPTIONAL, '<think>\nHmm.\n</think>\n\n{"a": 1}', "\nHmm.\n", '{"a": 1}'),
    (QWEN3, OPTIONAL, "Plain answer.", "", "Plain answer."),
    (QWEN3, OPTIONAL, "  Plain answer.", "", "  Plain answer."),
    (QWEN3, OPTIONAL, "<thinking is fun", "", "<thinking is fun"),
    (QWEN3, OPTIONAL, "<thi", "", "<thi"),
    (QWEN3, OPTIONAL, "<think>cut short", "cut short", ""),
    (QWEN3, OPTIONAL, "\n", "", "\n"),
    (QWEN3, REASONING, "Hmm.</think>ok", "Hmm.", "ok"),
    (QWEN3, NONE, "<think>a</think>b", "", "<think>a</think>b"),
    (THINK, OPTIONAL, "<think></think>\n\nDone", "", "Done"),
    (THINK, OPTIONAL, "Done <think>x</think>", "", "Done <think>x</think>"),
    (THINK, OPTIONAL, "<think>é 🙂</think> ü", "é 🙂", "ü"),
    (THINK, OPTIONAL, "", "", ""),
]
IDS = [f"{parser.name}-{start.value}-{index}" for index, (parser, start, *_) in enumerate(CASES)]


def streamed(parser, start, pieces) -> tuple[str, str, list[ReasoningDelta]]:
    splitter = ReasoningSplitter(parser, start)
    deltas = [splitter.feed(piece) for piece in pieces] + [splitter.finish()]
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas), deltas


def splits(text: str):
    yield [text]
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
        for j in range(i, len(text) + 1):
            yield [text[:i], text[i:j], text[j:]]


@pytest.mark.parametrize(("parser", "start", "text", "reasoning", "content"), CASES, ids=IDS)
def test_whole_text(parser, start, text, reasoning, content):
    assert split_reasoning(parser, start, text) == ReasoningDelta(reasoning, content)


@pytest.mark.parametrize(("parser", "start", "text", "reasoning", "content"), CASES, ids=IDS)
def test_every_split_streams_the_same_split(parser, start, text, reasoning, content):
    """Deltas only add text, so equal totals also mean no piece ever sent a part of a consumed tag."""
    for pieces in splits(text):
        assert streamed(parser, start, pieces)[:2] == (reasoning, content), pieces


@settings(max_examples=200, deadline=None)
@given(
    case=st.sampled_from(CASES),
    cuts=st.lists(st.integers(min_value=0, max_value=60), max_size=12),
)
def test_random_splits(case, cuts):
    parser, start, text, reasoning, content = case
    points = sorted({min(cut, len(text)) for cut in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    assert streamed(parser, start, pieces)[:2] == (reasoning, content)


def test_a_piece_ending_in_part_of_the_end_tag_is_held_until_it_is_known():
    splitter = ReasoningSplitter(R1, REASONING)
    assert splitter.feed("abc</th") == ReasoningDelta("abc", "")
    assert splitter.feed("ink>\n") == ReasoningDelta("", "")
    assert splitter.feed("\nanswer") == ReasoningDelta("", "answer")
    splitter = ReasoningSplitter(R1, REASONING)
    assert splitter.feed("abc</th") == ReasoningDelta("abc", "")
    assert splitter.feed("e end") == ReasoningDelta("</the end", "")


def test_the_opening_tag_is_waited_for_then_text_flows():
    splitter = ReasoningSplitter(THINK, OPTIONAL)
    assert splitter.feed(" <th") == ReasoningDelta()
    assert splitter.feed("ink>why") == ReasoningDelta("why", "")
    splitter = ReasoningSplitter(THINK, OPTIONAL)
    assert splitter.feed(" <th") == ReasoningDelta()
    assert splitter.feed("e end") == ReasoningDelta("", " <the end")


@pytest.mark.parametrize(
    ("parser", "tail", "kwargs", "start"),
    [
        (R1, "<｜Assistant｜><think>\n", {}, REASONING),
        (R1, "<｜Assistant｜>", {}, REASONING),
        (R1, "<think>\n\n</think>\n\n", {}, NONE),
        (QWEN3, "<|im_start|>assistant\n", {}, OPTIONAL),
        (QWEN3, "<|im_start|>assistant\n<think>\n", {}, REASONING),
        (QWEN3, "<|im_start|>assistant\n<think>\n\n</think>\n\n", {}, NONE),
        (QWEN3, "<|im_start|>assistant\n", {"enable_thinking": False}, NONE),
        (QWEN3, "<|im_start|>assistant\n<think>\n", {"enable_thinking": True}, REASONING),
        (THINK, "<|im_start|>assistant\n", {"enable_thinking": False}, OPTIONAL),
        (THINK, "assistant: <think>", {}, REASONING),
    ],
)
def test_the_prompt_and_the_convention_decide_where_the_reply_starts(parser, tail, kwargs, start):
    assert parser.start(tail, kwargs) is start


def test_an_unknown_parser_names_the_known_ones():
    assert reasoning_parser("qwen3") is QWEN3
    with pytest.raises(
        ValueError, match=r"unknown reasoning parser 'r1': choose one of deepseek_r1, qwen3, think"
    ):
        reasoning_parser("r1")


# ---------------------------------------------------------------- the grammar after the reasoning

MODEL = SyntheticModel(vocab_size=95, eos_token_id=94)
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}


def matches(grammar: str, text: str) -> bool:
    """Whether ``text``, one token per character, is a complete output of ``grammar``."""
    matcher = llguidance.LLMatcher(guidance_tokenizer(MODEL), grammar, log_level=0, limits=parser_limits())
    assert not matcher.is_error(), matcher.get_error()
    return all(matcher.consume_token(t) for t in MODEL.tokenizer.encode(text)) and matcher.is_accepting()


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ('I {think} "so"; <b>.</think>{"answer": "yes"}', True),  # the reasoning is free text
        ('why</think>   {"answer": "no"}', True),  # the codec has no newline: spaces
        ('</think>{"answer": "no"}', True),
        ('<think>x</think>{"answer": "no"}', True),
        ('why</think>{"answer": "maybe"}', False),  # the answer follows the schema
        ('why</think>{"answer":"no"}', False),  # ... as json.dumps writes it
        ("why</think>yes", False),
        ('why</think>{"answer": "no"}</think>', False),  # the reasoning ends at the first end tag
        ("still thinking", False),  # incomplete: the turn cannot end before the answer
    ],
)
def test_a_json_schema_applies_after_the_end_tag(text, ok):
    grammar = constraint_after_text("json_schema", SCHEMA, end="</think>")
    assert matches(grammar, text) is ok


@pytest.mark.parametrize(
    ("text", "ok"),
    [("ab", True), (" <think>x{</think> ab", True), ("<think>x</think>", False), ("x", False)],
)
def test_an_optional_reasoning_block_then_a_regex(text, ok):
    grammar = constraint_after_text("regex", "a+b", end="</think>", opener="<think>")
    assert matches(grammar, text) is ok


def test_a_client_grammar_keeps_its_own_rules_inside_the_nested_one():
    grammar = constraint_after_text(
        "lark_grammar", 'start: "}" | num\nnum: /[0-9]+/', end="</think>", opener=None
    )
    assert matches(grammar, "a</think>}") and matches(grammar, "a</think>42")
    assert not matches(grammar, "a</think>x")


def test_constrain_after_reasoning_wraps_only_a_constraint_that_has_reasoning_before_it():
    plain = SamplingParams(max_tokens=8)
    schema = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    assert constrain_after_reasoning(plain, R1, REASONING) is plain
    assert constrain_after_reasoning(schema, QWEN3, NONE) is schema
    wrapped = constrain_after_reasoning(schema, R1, REASONING).structured_outputs
    assert wrapped.kind == "grammar"
    assert matches(wrapped.grammar, 'ok</think>{"answer": "yes"}')
    optional = constrain_after_reasoning(schema, QWEN3, OPTIONAL).structured_outputs
    assert matches(optional.grammar, '{"answer": "no"}')
    assert matches(optional.grammar, '<think>a</think>{"answer": "no"}')
    assert json.loads('{"answer": "no"}') == {"answer": "no"}
