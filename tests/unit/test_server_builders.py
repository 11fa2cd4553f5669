"""What the serving loop asks of every payload builder: its reasoning split (a property of each builder
type, never found by probing a wrapper's attributes) and a sibling for another choice."""

from __future__ import annotations

from pagedgen.models.synthetic import SyntheticTokenizer
from pagedgen.server.reasoning import REASONING_PARSERS, ReasoningResponses, ReasoningStart
from pagedgen.server.responses import ChatResponses, CompletionResponses
from pagedgen.server.responses_api.output import ResponseBuilder

CODEC = SyntheticTokenizer(64)
THINK = REASONING_PARSERS["think"]


def chat() -> ChatResponses:
    return ChatResponses("m", CODEC, None, False)


def responses(inner: ChatResponses | ReasoningResponses, done: list) -> ResponseBuilder:
    return ResponseBuilder(inner, {"id": "resp_x", "object": "response"}, lambda r, m: done.append(m))


def test_plain_builders_have_no_reasoning_split():
    assert chat().reasoning_split is None
    assert CompletionResponses("m", CODEC, None, False).reasoning_split is None
    assert responses(chat(), []).reasoning_split is None


def test_a_reasoning_builder_is_its_own_split_and_a_responses_turn_reasons_as_its_chat_builder():
    split = ReasoningResponses(chat(), THINK, {})
    assert split.reasoning_split is split
    assert responses(split, []).reasoning_split is split


def test_a_responses_sibling_shares_the_header_but_has_its_own_split():
    done: list = []
    split = ReasoningResponses(chat(), THINK, {})
    split.begin("<think>")  # the prompt opened the reasoning
    first = responses(split, done)
    other = first.sibling()
    assert isinstance(other, ResponseBuilder) and other is not first
    sibling_split = other.reasoning_split
    assert sibling_split is not None and sibling_split is not split
    assert sibling_split.reasoning_start is ReasoningStart.REASONING
    assert other.first_chunk()[0]["response"]["id"] == first.first_chunk()[0]["response"]["id"] == "resp_x"
