"""Responses objects and stream events, translated from the chat route's payloads of the same turn, so
tool calls and reasoning come out as the chat route makes them. docs/server.md, "The Responses API", has
the items, the events and the usage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedgen.sampling.logprobs import TokenLogprob
from pagedgen.server.protocol import new_id
from pagedgen.server.reasoning import ReasoningResponses
from pagedgen.server.responses import ChatResponses
from pagedgen.server.worker import Finish

if TYPE_CHECKING:
    from pagedgen.core.json_value import JsonObject, JsonValue


@dataclass(slots=True)
class _Item:
    """An output item being built: a message's text, or a function call's arguments."""

    kind: str  # "message", "function_call" or "reasoning"
    id: str
    output_index: int
    text: str = ""
    call_id: str = ""
    name: str = ""
    open: bool = True

    def payload(self, status: str) -> JsonObject:
        if self.kind == "reasoning":
            content = [_part("reasoning", self.text)] if status != "in_progress" else []
            return {"id": self.id, "type": "reasoning", "status": status, "summary": [], "content": content}
        if self.kind == "message":
            return {
                "id": self.id,
                "type": "message",
                "status": status,
                "role": "assistant",
                "content": [_part("message", self.text)] if status != "in_progress" else [],
            }
        return {
            "id": self.id,
            "type": "function_call",
            "status": status,
            "call_id": self.call_id,
            "name": self.name,
            "arguments": self.text,
        }


def _part(kind: str, text: str) -> JsonObject:
    """A message's ``output_text`` part, or a reasoning item's ``reasoning_text``."""
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


_TEXT_EVENTS = {"message": "response.output_text", "reasoning": "response.reasoning_text"}


class ResponseBuilder:
    """The payload builder of one Responses turn; ``on_done(response, assistant_message)`` is called once
    with the finished response and its output as a chat message.

    Each piece of output goes to the chat builder, and what comes back becomes items: the text one
    ``message`` item with an ``output_text`` part, each tool call a ``function_call`` item, separated
    reasoning a ``reasoning`` item. One item streams at a time (opening the next closes the one before);
    every event has the next ``sequence_number``, from 0; a turn that produced nothing still answers one
    empty message, as OpenAI does.
    """

    include_usage = True  # the stream's last event, response.completed, carries the usage

    def __init__(
        self,
        chat: ChatResponses | ReasoningResponses,
        header: JsonObject,
        on_done: Callable[[JsonObject, JsonObject], None],
    ):
        self._chat = chat
        self._header = header
        self._on_done = on_done
        self.input_tokens = 0  # the prompt's length, set once it is tokenized
        self._sequence = 0
        self._items: list[_Item] = []
        self._calls: dict[int, _Item] = {}  # the chat route's tool-call index -> its item
        self._status = "in_progress"

    @property
    def reasoning_split(self) -> ReasoningResponses | None:
        """The chat builder's: a Responses turn reasons as the chat route's turn would."""
        return self._chat.reasoning_split

    def sibling(self) -> ResponseBuilder:
        """Another choice of the same response (its own output items; the same header and ``on_done``)."""
        return ResponseBuilder(self._chat.sibling(), self._header, self._on_done)

    # ------------------------------------------------------------ the chat route's builder interface

    def first_chunk(self) -> list[JsonObject]:
        events = [
            self._event("response.created", response=self._response([], None)),
            self._event("response.in_progress", response=self._response([], None)),
        ]
        return events + self._delta(self._chat.first_chunk()["choices"][0]["delta"])

    def chunk(
        self, text: str, logprobs: Sequence[TokenLogprob], finish_reason: str | None
    ) -> list[JsonObject] | None:
        chunk = self._chat.chunk(text, logprobs, finish_reason)
        if chunk is None:
            return None
        choice = chunk["choices"][0]
        events = self._delta(choice["delta"])
        if finish_reason is not None:
            self._status = _status(choice["finish_reason"])
            if not any(item.kind == "message" or item.kind == "function_call" for item in self._items):
                events += self._open("message")
            for item in self._items:
                events += self._close(item)
        return events

    def usage_chunk(self, finish: Finish) -> list[JsonObject]:
        response = self._finished(finish)
        kind = "response.completed" if self._status == "completed" else "response.incomplete"
        return [self._event(kind, response=response)]

    def full(
        self, text: str, logprobs: Sequence[TokenLogprob], finish_reason: str, finish: Finish
    ) -> JsonObject:
        choice = self._chat.full(text, logprobs, finish_reason, finish)["choices"][0]
        message = choice["message"]
        self._status = _status(choice["finish_reason"])
        reasoning = _reasoning(message)
        if reasoning:
            self._items.append(_Item("reasoning", new_id("rs", "_"), 0, reasoning))
        if message.get("content") or not message.get("tool_calls"):
            self._items.append(
                _Item("message", new_id("msg", "_"), len(self._items), message.get("content") or "")
            )
        for call in message.get("tool_calls") or ():
            function = call["function"]
            item = _Item("function_call", new_id("fc", "_"), len(self._items), function["arguments"])
            item.call_id, item.name = call["id"], function["name"]
            self._items.append(item)
        return self._finished(finish)

    # ------------------------------------------------------------ translation

    def _delta(self, delta: JsonObject) -> list[JsonObject]:
        events: list[JsonObject] = []
        for kind, text in (("reasoning", _reasoning(delta)), ("message", delta.get("content"))):
            if text:
                last = self._items[-1] if self._items else None
                if last is None or last.kind != kind or not last.open:
                    events += self._open(kind)
                    last = self._items[-1]
                last.text += text
                events.append(self._text_event(f"{_TEXT_EVENTS[kind]}.delta", last, delta=text))
        for call in delta.get("tool_calls") or ():
            item = self._calls.get(call["index"])
            function = call.get("function") or {}
            if item is None:
                events += self._close_open()
                item = _Item("function_call", new_id("fc", "_"), len(self._items))
                item.call_id, item.name = call.get("id") or "", function.get("name") or ""
                self._items.append(item)
                self._calls[call["index"]] = item
                events.append(self._item_event("response.output_item.added", item, "in_progress"))
            arguments = function.get("arguments") or ""
            if arguments:
                item.text += arguments
                kind = "response.function_call_arguments.delta"
                events.append(self._event(kind, **self._at(item), delta=arguments))
        return events

    def _open(self, kind: str) -> list[JsonObject]:
        """Close the item being streamed, and open a message or reasoning item (one streams at a time)."""
        events = self._close_open()
        item = _Item(kind, new_id("msg" if kind == "message" else "rs", "_"), len(self._items))
        self._items.append(item)
        return events + [
            self._item_event("response.output_item.added", item, "in_progress"),
            self._text_event("response.content_part.added", item, part=_part(kind, "")),
        ]

    def _close_open(self) -> list[JsonObject]:
        events: list[JsonObject] = []
        for item in self._items:
            events += self._close(item)
        return events

    def _close(self, item: _Item) -> list[JsonObject]:
        if not item.open:
            return []
        item.open = False
        status = "incomplete" if self._status == "incomplete" else "completed"
        if item.kind != "function_call":
            events = [
                self._text_event(f"{_TEXT_EVENTS[item.kind]}.done", item, text=item.text),
                self._text_event("response.content_part.done", item, part=_part(item.kind, item.text)),
            ]
        else:
            done = self._event(
                **self._at(item), type="response.function_call_arguments.done", arguments=item.text
            )
            events = [{**done, "name": item.name}]
        return events + [self._item_event("response.output_item.done", item, status)]

    # ------------------------------------------------------------ payloads

    def _finished(self, finish: Finish) -> JsonObject:
        status = "incomplete" if self._status == "incomplete" else "completed"
        output = [item.payload(status) for item in self._items]
        response = self._response(output, _usage(self.input_tokens, finish))
        self._on_done(response, self._assistant_message())
        return response

    def _response(self, output: list[JsonObject], usage: JsonObject | None) -> JsonObject:
        incomplete = {"reason": "max_output_tokens"} if self._status == "incomplete" else None
        return {
            **self._header,
            "status": self._status,
            "output": output,
            "usage": usage,
            "incomplete_details": incomplete,
        }

    def _assistant_message(self) -> JsonObject:
        """The turn's output as the chat message a follow-up's conversation holds."""
        text = "".join(item.text for item in self._items if item.kind == "message")
        calls = [
            {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.text}}
            for item in self._items
            if item.kind == "function_call"
        ]
        message: JsonObject = {"role": "assistant", "content": text if text or not calls else None}
        if calls:
            message["tool_calls"] = calls
        return message

    def _event(self, type: str, **fields: JsonValue) -> JsonObject:  # noqa: A002 - the wire's name
        event = {"type": type, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _at(self, item: _Item) -> JsonObject:
        return {"item_id": item.id, "output_index": item.output_index}

    def _item_event(self, kind: str, item: _Item, status: str) -> JsonObject:
        return self._event(kind, output_index=item.output_index, item=item.payload(status))

    def _text_event(self, kind: str, item: _Item, **fields: JsonValue) -> JsonObject:
        extra = {"logprobs": []} if kind.startswith("response.output_text") else {}
        return self._event(kind, **self._at(item), content_index=0, **fields, **extra)


def _reasoning(message: JsonObject) -> str:
    """The reasoning text of a chat message or delta (``reasoning_content``, or vLLM's newer
    ``reasoning``), when the chat route separates it."""
    return message.get("reasoning_content") or message.get("reasoning") or ""


def _status(finish_reason: str) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _usage(input_tokens: int, finish: Finish) -> JsonObject:
    cached = min(max(finish.reused_tokens, finish.cached_prompt_tokens), input_tokens)
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": finish.generated_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + finish.generated_tokens,
    }
