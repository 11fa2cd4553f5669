"""Response payloads in the OpenAI wire format, for both routes, streaming and not.

One builder per HTTP request keeps what one stream's chunks share (id, creation time, model, the
completions API's logprob text offset) and builds plain dicts, which go straight to ``json.dumps`` on the
hot path; forced and automatic tool calls come out as OpenAI and vLLM shape them. docs/server.md,
"Responses", "Structured outputs and tools" and "Automatic tool calls", has the shapes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, TypeAlias

from pagedgen.sampling.logprobs import TokenLogprob
from pagedgen.server.auto_tools import AutoToolCalls
from pagedgen.server.protocol import new_id
from pagedgen.server.tool_parsers import ParserDelta, ToolCallParser
from pagedgen.server.tools import ForcedToolCalls, new_tool_call_id, parse_required_calls, tool_call
from pagedgen.server.worker import Finish

if TYPE_CHECKING:
    from pagedgen.core.json_value import JsonObject, JsonValue
    from pagedgen.llm import TextTokenizer
    from pagedgen.server.reasoning import ReasoningResponses

# One payload, or (the Responses API's) the list of events one piece of output becomes.
Payload: TypeAlias = "JsonObject | list[JsonObject]"


class PayloadBuilder(Protocol):
    """What the serving loop asks of a route's payload builder (:class:`ChatResponses`,
    :class:`CompletionResponses`, the reasoning split over a chat builder, the Responses API's builder)."""

    @property
    def include_usage(self) -> bool: ...

    @property
    def reasoning_split(self) -> ReasoningResponses | None:
        """The split of reasoning and content the reply goes through (its prompt decides where it starts),
        None without a reasoning parser."""
        ...

    def first_chunk(self) -> Payload | None: ...

    def chunk(
        self, text: str, logprobs: Sequence[TokenLogprob], finish_reason: str | None
    ) -> Payload | None: ...

    def usage_chunk(self, finish: Finish) -> Payload: ...

    def full(
        self, text: str, logprobs: Sequence[TokenLogprob], finish_reason: str, finish: Finish
    ) -> JsonObject: ...

    def sibling(self) -> PayloadBuilder: ...


def usage_dict(finish: Finish) -> JsonObject:
    return {
        "prompt_tokens": finish.prompt_tokens,
        "completion_tokens": finish.generated_tokens,
        "total_tokens": finish.prompt_tokens + finish.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": finish.cached_prompt_tokens},
    }


class _Builder:
    id_prefix = ""

    def __init__(self, model_name: str, tokenizer: TextTokenizer, logprobs: int | None, include_usage: bool):
        self.id = new_id(self.id_prefix)
        self.created = int(time.time())
        self.model = model_name
        self._tokenizer = tokenizer
        self.top_n = logprobs
        self.include_usage = include_usage

    @property
    def reasoning_split(self) -> ReasoningResponses | None:
        return None  # a reasoning parser wraps the builder (pagedgen.server.reasoning)

    def sibling(self) -> _Builder:
        """A fresh builder for another choice of the same response (same id, creation time and settings;
        its own per-choice state)."""
        other = self._fresh()  # each builder class constructs itself with its own settings
        other.id, other.created = self.id, self.created
        return other

    def _token_text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def _envelope(self, obj: str, choices: list[JsonObject], **extra: JsonValue) -> JsonObject:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }


class ChatResponses(_Builder):
    """``chat.completion`` and ``chat.completion.chunk`` payloads; ``tools`` when the turn is a forced tool
    call, ``auto`` when it may call tools (docs/server.md, "Structured outputs and tools" and "Automatic
    tool calls": a named function streams its arguments, a ``"required"`` list is parsed when the turn ends,
    output that does not parse is ``content`` with the engine's finish reason)."""

    id_prefix = "chatcmpl"

    def __init__(
        self,
        model_name: str,
        tokenizer: TextTokenizer,
        logprobs: int | None,
        include_usage: bool,
        tools: ForcedToolCalls | None = None,
        auto: AutoToolCalls | None = None,
    ):
        super().__init__(model_name, tokenizer, logprobs, include_usage)
        self._tools = tools
        self._call_id = new_tool_call_id()
        self._held: list[str] = []  # a "required" stream's text, parsed when it ends
        self._auto = auto
        self._parser: ToolCallParser | None = None if auto is None else auto.parser()

    def _fresh(self) -> ChatResponses:
        return ChatResponses(
            self.model, self._tokenizer, self.top_n, self.include_usage, self._tools, self._auto
        )

    def first_chunk(self) -> JsonObject:
        if self._tools is None:
            return self._chunk({"role": "assistant", "content": ""}, None, None)
        delta: JsonObject = {"role": "assistant", "content": None}
        if self._tools.function is not None:
            call = tool_call(self._call_id, self._tools.function, "")
            delta["tool_calls"] = [{"index": 0, **call}]
        return self._chunk(delta, None, None)

    def chunk(
        self, text: str, logprobs: Sequence[TokenLogprob], finish_reason: str | None
    ) -> JsonObject | None:
        """One stream chunk, or None when there is nothing to send yet (a "required" list being held)."""
        entries = self.logprobs(logprobs) if logprobs else None
        if self._parser is not None:
            return self._auto_chunk(self._parser, text, entries, finish_reason)
        if self._tools is None:
            return self._chunk({"content": text} if text else {}, entries, finish_reason)
        if self._tools.function is not None:
            delta = {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}
            return self._chunk(delta, entries, finish_reason)
        self._held.append(text)
        if finish_reason is None:
            return self._chunk({}, entries, None) if entries else None
        message, reason = self._required_message("".join(self._held), finish_reason)
        if message["tool_calls"] is None:
            delta = {"content": message["content"]}
        else:
            delta = {"tool_calls": [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]}
        return self._chunk(delta, entries, reason)

    def _auto_chunk(
        self, parser: ToolCallParser, text: str, entries: JsonObject | None, finish_reason: str | None
    ) -> JsonObject | None:
        parsed = parser.feed(text)
        if finish_reason is not None:
            parsed.extend(parser.finish())
            finish_reason = _auto_finish_reason(parser, finish_reason)
        elif not parsed and entries is None:
            return None  # text held back (a trigger's beginning, whitespace before a call)
        return self._chunk(auto_delta(parsed), entries, finish_reason)

    def _chunk(self, delta: JsonObject, logprobs: JsonObject | None, finish_reason: str | None) -> JsonObject:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        extra = {"usage": None} if self.include_usage else {}
        return self._envelope("chat.completion.chunk", [choice], **extra)

    def usage_chunk(self, finish: Finish) -> JsonObject:
        return self._envelope("chat.completion.chunk", [], usage=usage_dict(finish))

    def full(
        self, text: str, logprobs: Sequence[TokenLogprob], finish_reason: str, finish: Finish
    ) -> JsonObject:
        message, finish_reason = self._message(text, finish_reason)
        choice = {
            "index": 0,
            "message": message,
            "logprobs": self.logprobs(logprobs) if self.top_n is not None else None,
            "finish_reason": finish_reason,
        }
        return self._envelope("chat.completion", [choice], usage=usage_dict(finish))

    def _message(self, text: str, finish_reason: str) -> tuple[JsonObject, str]:
        """The assistant message of a whole turn and its finish reason."""
        if self._parser is not None:
            return _auto_message(self._parser, text, finish_reason)
        if self._tools is None:
            return {"role": "assistant", "content": text}, finish_reason
        if self._tools.function is not None:
            call = tool_call(self._call_id, self._tools.function, text)
            return {"role": "assistant", "content": None, "tool_calls": [call]}, finish_reason
        return self._required_message(text, finish_reason)

    def _required_message(self, text: str, finish_reason: str) -> tuple[JsonObject, str]:
        calls = parse_required_calls(text) if finish_reason == "stop" else None
        if calls is None:
            return {"role": "assistant", "content": text, "tool_calls": None}, finish_reason
        tool_calls = [tool_call(new_tool_call_id(), name, arguments) for name, arguments in calls]
        return {"role": "assistant", "content": None, "tool_calls": tool_calls}, "tool_calls"

    def logprobs(self, entries: Sequence[TokenLogprob]) -> JsonObject:
        content = []
        for entry in entries:
            top = [self._alternative(t, lp) for t, lp in entry.top[: self.top_n or 0]]
            content.append({**self._alternative(entry.token_id, entry.logprob), "top_logprobs": top})
        return {"content": content}

    def _alternative(self, token_id: int, logprob: float) -> JsonObject:
        text = self._token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def auto_delta(parsed: ParserDelta) -> JsonObject:
    """The stream delta of parsed text: ``content`` and OpenAI's tool-call deltas (a call's pieces within
    one chunk merged into one entry)."""
    delta: JsonObject = {}
    if parsed.content:
        delta["content"] = parsed.content
    entries: list[JsonObject] = []
    for call in parsed.calls:
        if entries and entries[-1]["index"] == call.index:
            entries[-1]["function"]["arguments"] += call.arguments
            continue
        entry: JsonObject = {"index": call.index}
        if call.id is not None:
            entry.update(
                id=call.id, type="function", function={"name": call.name, "arguments": call.arguments}
            )
        else:
            entry["function"] = {"arguments": call.arguments}
        entries.append(entry)
    if entries:
        delta["tool_calls"] = entries
    return delta


def _auto_message(parser: ToolCallParser, text: str, finish_reason: str) -> tuple[JsonObject, str]:
    parser.feed(text)
    parser.finish()
    if not parser.calls:
        return {"role": "assistant", "content": parser.content}, finish_reason
    calls = [tool_call(call.id, call.name, call.arguments) for call in parser.calls]
    message = {"role": "assistant", "content": parser.content or None, "tool_calls": calls}
    return message, _auto_finish_reason(parser, finish_reason)


def _auto_finish_reason(parser: ToolCallParser, finish_reason: str) -> str:
    return "tool_calls" if finish_reason == "stop" and parser.complete else finish_reason


class CompletionResponses(_Builder):
    """``text_completion`` payloads (the streaming chunks have the same object type); ``echo``, the prompt's
    text, comes before the generated text (a stream sends it first, in a chunk of its own)."""

    id_prefix = "cmpl"

    def __init__(
        self,
        model_name: str,
        tokenizer: TextTokenizer,
        logprobs: int | None,
        include_usage: bool,
        echo: str = "",
    ):
        super().__init__(model_name, tokenizer, logprobs, include_usage)
        self._offset = 0  # text offset of the next logprob entry
        self._echo = echo

    def _fresh(self) -> CompletionResponses:
        return CompletionResponses(self.model, self._tokenizer, self.top_n, self.include_usage, self._echo)

    def first_chunk(self) -> JsonObject | None:
        return self.chunk(self._echo, (), None) if self._echo else None

    def chunk(self, text: str, logprobs: Sequence[TokenLogprob], finish_reason: str | None) -> JsonObject:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": self.logprobs(logprobs) if logprobs else None,
            "finish_reason": finish_reason,
        }
        extra = {"usage": None} if self.include_usage else {}
        return self._envelope("text_completion", [choice], **extra)

    def usage_chunk(self, finish: Finish) -> JsonObject:
        return self._envelope("text_completion", [], usage=usage_dict(finish))

    def full(
        self, text: str, logprobs: Sequence[TokenLogprob], finish_reason: str, finish: Finish
    ) -> JsonObject:
        choice = {
            "index": 0,
            "text": self._echo + text,
            "logprobs": self.logprobs(logprobs) if self.top_n is not None else None,
            "finish_reason": finish_reason,
        }
        return self._envelope("text_completion", [choice], usage=usage_dict(finish))

    def logprobs(self, entries: Sequence[TokenLogprob]) -> JsonObject:
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for entry in entries:
            text = self._token_text(entry.token_id)
            tokens.append(text)
            token_logprobs.append(entry.logprob)
            top_logprobs.append({self._token_text(t): lp for t, lp in entry.top[: self.top_n or 0]})
            offsets.append(self._offset)
            self._offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }
