"""Reasoning output (``pagedgen serve --reasoning-parser NAME``): ``<think> ... </think>`` to
``message.reasoning_content`` (and ``reasoning``), the rest to ``content``, whole or streamed.

The prompt decides first where a reply starts (:meth:`ReasoningParser.start`), each convention
(:data:`REASONING_PARSERS`) then reads the reply's text, and an output constraint moves after the reasoning
(:meth:`ReasoningResponses.constrain`, exact as :mod:`pagedgen.guidance.prefixed` says). docs/server.md,
"Reasoning output", has the conventions and why.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedgen.guidance.prefixed import constraint_after_text
from pagedgen.sampling.logprobs import TokenLogprob
from pagedgen.sampling.params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from pagedgen.core.json_value import JsonObject, JsonValue
    from pagedgen.server.responses import ChatResponses
    from pagedgen.server.worker import Finish

PROMPT_TAIL_TOKENS = 16  # the prompt's last tokens, decoded, tell whether its template opened the reasoning


class ReasoningStart(enum.Enum):
    """Where a reply starts, as its prompt and the convention say."""

    REASONING = "reasoning"  # inside the reasoning (the prompt opened it, or DeepSeek-R1's rule)
    OPTIONAL = "optional"  # the reply may open a reasoning block with the start tag
    NONE = "none"  # no reasoning: the prompt closed it, or thinking is disabled


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    """One convention: its tags, whether a reply reasons from its first token, and whether
    ``enable_thinking`` in ``chat_template_kwargs`` turns reasoning off."""

    name: str
    reasoning_first: bool = False
    honours_enable_thinking: bool = False
    start_tag: str = "<think>"
    end_tag: str = "</think>"

    def start(self, prompt_tail: str, template_kwargs: Mapping[str, JsonValue]) -> ReasoningStart:
        """Where the reply to a prompt ending in ``prompt_tail`` starts."""
        if self.honours_enable_thinking and template_kwargs.get("enable_thinking") is False:
            return ReasoningStart.NONE
        tail = prompt_tail.rstrip()
        if tail.endswith(self.end_tag):
            return ReasoningStart.NONE
        if tail.endswith(self.start_tag) or self.reasoning_first:
            return ReasoningStart.REASONING
        return ReasoningStart.OPTIONAL


REASONING_PARSERS = {
    "deepseek_r1": ReasoningParser("deepseek_r1", reasoning_first=True),
    "qwen3": ReasoningParser("qwen3", honours_enable_thinking=True),
    "think": ReasoningParser("think"),
}


def reasoning_parser(name: str) -> ReasoningParser:
    """The parser named ``name``; ``ValueError`` naming the known ones otherwise."""
    parser = REASONING_PARSERS.get(name)
    if parser is None:
        known = ", ".join(sorted(REASONING_PARSERS))
        raise ValueError(f"unknown reasoning parser {name!r}: choose one of {known}")
    return parser


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """What a piece of reply text adds to the reasoning and to the content."""

    reasoning: str = ""
    content: str = ""


class _Mode(enum.Enum):
    OPENING = enum.auto()  # before the first non-whitespace text: does it open with the start tag?
    REASONING = enum.auto()
    CLOSED = enum.auto()  # right after the end tag: whitespace is dropped
    CONTENT = enum.auto()


class ReasoningSplitter:
    """Splits one reply's text, fed in pieces of any size, into reasoning and content.

    A tag may arrive split over pieces: text that could still be the start of a tag is held back until the
    next piece (or :meth:`finish`) says what it is, so a stream never sends part of a tag.
    """

    def __init__(self, parser: ReasoningParser, start: ReasoningStart):
        self._parser = parser
        self._mode = _Mode.CONTENT if start is ReasoningStart.NONE else _Mode.OPENING
        self._fallback = _Mode.REASONING if start is ReasoningStart.REASONING else _Mode.CONTENT
        self._held = ""

    def feed(self, text: str) -> ReasoningDelta:
        reasoning: list[str] = []
        content: list[str] = []
        text, self._held = self._held + text, ""
        while text:
            if self._mode is _Mode.OPENING:
                text = self._opening(text)
            elif self._mode is _Mode.REASONING:
                text = self._reasoning(text, reasoning)
            elif self._mode is _Mode.CLOSED:
                text = text.lstrip()
                if text:
                    self._mode = _Mode.CONTENT
            else:
                content.append(text)
                text = ""
        return ReasoningDelta("".join(reasoning), "".join(content))

    def finish(self) -> ReasoningDelta:
        """The text still held back when the reply ends (an unfinished tag is text)."""
        held, self._held = self._held, ""
        if self._mode is _Mode.OPENING:
            self._mode = self._fallback
        if self._mode is _Mode.REASONING:
            return ReasoningDelta(reasoning=held)
        return ReasoningDelta(content=held if self._mode is _Mode.CONTENT else "")

    def _opening(self, text: str) -> str:
        tag = self._parser.start_tag
        stripped = text.lstrip()
        if stripped.startswith(tag):
            self._mode = _Mode.REASONING
            return stripped[len(tag) :]
        if tag.startswith(stripped):  # whitespace, or a part of the tag: wait for more
            self._held = text
            return ""
        self._mode = self._fallback
        return text

    def _reasoning(self, text: str, reasoning: list[str]) -> str:
        tag = self._parser.end_tag
        at = text.find(tag)
        if at >= 0:
            reasoning.append(text[:at])
            self._mode = _Mode.CLOSED
            return text[at + len(tag) :]
        keep = _tag_prefix_at_end(text, tag)
        reasoning.append(text[: len(text) - keep])
        self._held = text[len(text) - keep :]
        return ""


def _tag_prefix_at_end(text: str, tag: str) -> int:
    """The length of the longest proper prefix of ``tag`` that ``text`` ends with."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def split_reasoning(parser: ReasoningParser, start: ReasoningStart, text: str) -> ReasoningDelta:
    """A whole reply's reasoning and content."""
    splitter = ReasoningSplitter(parser, start)
    first, last = splitter.feed(text), splitter.finish()
    return ReasoningDelta(first.reasoning + last.reasoning, first.content + last.content)


def constrain_after_reasoning(
    params: SamplingParams, parser: ReasoningParser, start: ReasoningStart
) -> SamplingParams:
    """``params`` whose output constraint applies after the reasoning (unchanged without a constraint or
    without reasoning); raises ``SamplingOptionsError`` if the combined grammar does not compile."""
    constraint = params.structured_outputs
    if constraint is None or start is ReasoningStart.NONE:
        return params
    opener = None if start is ReasoningStart.REASONING else parser.start_tag
    grammar = constraint_after_text(*constraint.guidance(), end=parser.end_tag, opener=opener)
    return dataclasses.replace(params, structured_outputs=StructuredOutputsParams(grammar=grammar))


def _reasoning_fields(reasoning: str) -> dict[str, str | None]:
    value = reasoning or None
    return {"reasoning_content": value, "reasoning": value}


class ReasoningResponses:
    """A chat response builder (:class:`pagedgen.server.responses.ChatResponses`) whose replies are split
    into reasoning and content: the content goes through the inner builder (plain text or a forced tool
    call), the reasoning is added to each delta and to the message.

    :meth:`begin` must be called with the prompt's last tokens' text before the first chunk; siblings
    (``n > 1``) made after it start the same way, each with its own splitter.
    """

    def __init__(
        self, inner: ChatResponses, parser: ReasoningParser, template_kwargs: Mapping[str, JsonValue]
    ):
        self._inner = inner
        self._parser = parser
        self._template_kwargs = dict(template_kwargs)
        self._start = ReasoningStart.OPTIONAL
        self._splitter = ReasoningSplitter(parser, self._start)

    @property
    def include_usage(self) -> bool:
        return self._inner.include_usage

    @property
    def reasoning_split(self) -> ReasoningResponses:
        return self

    @property
    def reasoning_start(self) -> ReasoningStart:
        return self._start

    def begin(self, prompt_tail: str) -> None:
        self._start = self._parser.start(prompt_tail, self._template_kwargs)
        self._splitter = ReasoningSplitter(self._parser, self._start)

    def constrain(self, params: SamplingParams) -> SamplingParams:
        return constrain_after_reasoning(params, self._parser, self._start)

    def sibling(self) -> ReasoningResponses:
        other = ReasoningResponses(self._inner.sibling(), self._parser, self._template_kwargs)
        other._start = self._start
        other._splitter = ReasoningSplitter(self._parser, self._start)
        return other

    def first_chunk(self) -> JsonObject | None:
        return self._inner.first_chunk()

    def usage_chunk(self, finish: Finish) -> JsonObject:
        return self._inner.usage_chunk(finish)

    def chunk(
        self, text: str, logprobs: Sequence[TokenLogprob], finish_reason: str | None
    ) -> JsonObject | None:
        """One stream chunk (None while the piece only holds back text)."""
        delta = self._splitter.feed(text)
        if finish_reason is not None:
            last = self._splitter.finish()
            delta = ReasoningDelta(delta.reasoning + last.reasoning, delta.content + last.content)
        chunk = self._inner.chunk(delta.content, logprobs, finish_reason)
        if not delta.reasoning:
            return chunk
        if chunk is None:  # the inner builder holds its text (a "required" tool list): reasoning alone
            chunk = self._inner._chunk({}, None, None)
        chunk["choices"][0]["delta"].update(_reasoning_fields(delta.reasoning))
        return chunk

    def full(
        self, text: str, logprobs: Sequence[TokenLogprob], finish_reason: str, finish: Finish
    ) -> JsonObject:
        split = split_reasoning(self._parser, self._start, text)
        response = self._inner.full(split.content, logprobs, finish_reason, finish)
        message = response["choices"][0]["message"]
        if split.reasoning and message.get("content") == "":
            message["content"] = None
        message.update(_reasoning_fields(split.reasoning))
        return response
