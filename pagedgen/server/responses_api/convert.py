"""A Responses request as a chat-completions request: the messages, tools and output format it means,
so the chat route's one rule set applies and :func:`wire_param` names a refused field by its Responses
name. docs/server.md, "The Responses API", has the mapping.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedgen.server.responses_api.wire import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    NamedFunction,
    ResponsesRequest,
    TextFormatJsonObject,
    TextFormatJsonSchema,
)

if TYPE_CHECKING:
    from pagedgen.core.json_value import JsonObject
    from pagedgen.server.responses_api.wire import FunctionTool, InputItem

# Chat-route field names and the Responses names they stand for (the longest prefix first).
_WIRE_NAMES = (
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("messages", "input"),
)
_TOOL_FIELD = re.compile(r"^tools\[(\d+)\]\.function(\.|$)")


@dataclass(frozen=True, slots=True)
class ChatTurn:
    """The chat request of one Responses turn, and the conversation it continues (without the
    instructions), followed by this turn's input: a follow-up's stored conversation adds the output."""

    body: JsonObject
    conversation: list[JsonObject]


def chat_turn(request: ResponsesRequest, history: Sequence[JsonObject]) -> ChatTurn:
    """The chat body of a turn: ``instructions`` as a system message (a follow-up's replace the earlier
    ones, which are not carried over), the stored ``history``, then this turn's input items: messages as
    they are (text parts joined), ``function_call`` items as an assistant message's tool calls (consecutive
    calls in one message), ``function_call_output`` items as ``tool`` messages (named after the call they
    answer when it is in the conversation)."""
    conversation = [*history, *input_messages(request.input, history)]
    system = [{"role": "system", "content": request.instructions}] if request.instructions else []
    body: JsonObject = {
        "model": request.model,
        "messages": system + conversation,
        "stream": request.stream,
    }
    for name, value in (
        ("max_tokens", request.max_output_tokens),
        ("temperature", request.temperature),
        ("top_p", request.top_p),
        ("seed", request.seed),
        ("parallel_tool_calls", request.parallel_tool_calls),
        ("user", request.user),
    ):
        if value is not None:
            body[name] = value
    if request.tools:
        body["tools"] = [{"type": "function", "function": tool_function(tool)} for tool in request.tools]
    if isinstance(request.tool_choice, NamedFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": request.tool_choice.name}}
    elif request.tool_choice is not None:
        body["tool_choice"] = request.tool_choice
    response_format = _response_format(request)
    if response_format is not None:
        body["response_format"] = response_format
    return ChatTurn(body, conversation)


def tool_function(tool: FunctionTool) -> JsonObject:
    return tool.model_dump(exclude={"type"}, exclude_none=True)


def _response_format(request: ResponsesRequest) -> JsonObject | None:
    fmt = request.text_format
    if isinstance(fmt, TextFormatJsonSchema):
        spec = {"name": fmt.name, "schema": fmt.json_schema}
        spec.update(
            {k: v for k, v in (("description", fmt.description), ("strict", fmt.strict)) if v is not None}
        )
        return {"type": "json_schema", "json_schema": spec}
    if isinstance(fmt, TextFormatJsonObject):
        return {"type": "json_object"}
    return None


def input_messages(items: str | Sequence[InputItem], history: Sequence[JsonObject] = ()) -> list[JsonObject]:
    """The chat messages of a turn's input items (in the chat route's wire shape)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[JsonObject] = []
    names = {call["id"]: call["function"]["name"] for m in history for call in m.get("tool_calls") or ()}
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            names[item.call_id] = item.name
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # one assistant turn: its text, its calls
                last["tool_calls"] = [*(last.get("tool_calls") or ()), call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            message = {"role": "tool", "tool_call_id": item.call_id, "content": item.text}
            if item.call_id in names:
                message["name"] = names[item.call_id]
            messages.append(message)
    return messages  # reasoning items are skipped


def wire_param(param: str | None) -> str | None:
    """A chat-route field by its Responses name (``tools[0].function.name``: ``tools[0].name``)."""
    if param is None:
        return None
    match = _TOOL_FIELD.match(param)
    if match is not None:
        return f"tools[{match.group(1)}]" + param[match.end() - len(match.group(2)) :]
    for chat_name, name in _WIRE_NAMES:
        if param == chat_name or param.startswith(chat_name + ".") or param.startswith(chat_name + "["):
            return name + param[len(chat_name) :]
    return param


def wire_message(message: str, param: str | None) -> str:
    """A chat-route error message with the field it names spelled as the Responses request spells it."""
    if param is None:
        return message
    return message.replace(param, wire_param(param) or param)
