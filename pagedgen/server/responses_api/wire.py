"""The Responses API's request body (``POST /v1/responses``), as pydantic models.

Lenient about names like the chat route (:mod:`pagedgen.server.protocol`): an unknown top-level field
(``include``, ``reasoning``, ``truncation``, ``service_tier``, ``prompt_cache_key``, ...) or an unknown key
of an input item is ignored and logged once. What would change the answer and cannot be honoured is a 400
naming it: an input item or content part other than text, function calls and their outputs (reasoning
items sent back are skipped), a tool other than a function, ``background``, ``conversation``, ``prompt``.
The objects that constrain the output (``tools``, ``tool_choice``, ``text.format``) are strict.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from pagedgen.server.protocol import _Body, _Lenient, _Strict, field_error

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
PART_TYPES = ("input_text", "output_text", "text", "refusal")


class TextPart(_Lenient):
    """A text content part: ``input_text`` (a client's), ``output_text`` (an earlier answer sent back;
    its ``annotations`` and ``logprobs`` are ignored), or ``refusal``."""

    where = "input[].content[]"
    type: Literal["input_text", "output_text", "text", "refusal"]
    text: str | None = None
    refusal: str | None = None

    @property
    def content(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


class MessageItem(_Lenient):
    where = "input[]"
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.content for part in self.content)


class FunctionCallItem(_Lenient):
    """A function call of an earlier answer, sent back with the conversation."""

    where = "input[]"
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Lenient):
    """The result of a function call, for the model to read on this turn."""

    where = "input[]"
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]

    @property
    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.content for part in self.output)


class ReasoningItem(_Lenient):
    """An earlier answer's reasoning sent back: skipped (a chat template does not take it back either)."""

    where = "input[]"
    type: Literal["reasoning"]


def _item_type(item: object) -> str:
    if isinstance(item, dict):
        return str(item.get("type", "message"))
    return str(getattr(item, "type", "message"))


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class TextFormatText(_Strict):
    type: Literal["text"]


class TextFormatJsonObject(_Strict):
    type: Literal["json_object"]


class TextFormatJsonSchema(_Strict):
    type: Literal["json_schema"]
    name: Annotated[str, Field(min_length=1, max_length=64)]
    json_schema: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[
    TextFormatText | TextFormatJsonObject | TextFormatJsonSchema, Field(discriminator="type")
]


class TextConfig(_Lenient):
    where = "text"
    format: TextFormat | None = None  # verbosity is ignored


class ResponsesRequest(_Body):
    """``POST /v1/responses``: ``input`` (a string, or a list of items) after ``instructions``, and after
    the conversation of ``previous_response_id``; the sampling fields the chat route has under their
    Responses names (``max_output_tokens``), plus ``seed``."""

    model: str
    input: Annotated[
        Annotated[str, Tag("str")] | Annotated[list[InputItem], Field(min_length=1), Tag("list[item]")],
        Discriminator(lambda value: "str" if isinstance(value, str) else "list[item]"),  # tags read as types
    ]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = None
    temperature: Annotated[float, Field(le=2.0)] | None = None
    top_p: float | None = None
    seed: int | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None

    @model_validator(mode="before")
    @classmethod
    def _supported_types(cls, data: Any) -> Any:
        """A 400 naming an input item, content part or tool of a kind pagedgen does not serve (pydantic's
        own message for an unknown union tag does not say what is supported)."""
        if not isinstance(data, dict):
            return data
        items = data.get("input")
        for index, item in enumerate(items if isinstance(items, list) else ()):
            kind = _item_type(item)
            if kind not in ITEM_TYPES:
                raise field_error(
                    f"input[{index}].type",
                    f"input items of type {kind!r} are not supported: send message, function_call or "
                    "function_call_output items",
                )
            parts = item.get("content", item.get("output")) if isinstance(item, dict) else None
            for j, part in enumerate(parts if isinstance(parts, list) else ()):
                part_type = part.get("type") if isinstance(part, dict) else None
                if part_type not in PART_TYPES:
                    name = "content" if "content" in item else "output"
                    raise field_error(
                        f"input[{index}].{name}[{j}].type",
                        f"content of type {part_type!r} is not supported: pagedgen serves a text model "
                        "(send input_text)",
                    )
        tools = data.get("tools")
        for index, tool in enumerate(tools if isinstance(tools, list) else ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise field_error(
                    f"tools[{index}].type",
                    f"tools of type {kind!r} are not supported: pagedgen calls function tools only",
                )
        return data

    @model_validator(mode="after")
    def _served(self) -> ResponsesRequest:
        if self.background:
            raise field_error("background", "background responses are not supported: send background=false")
        for name in ("conversation", "prompt"):
            if getattr(self, name) is not None:
                raise field_error(
                    name,
                    f"{name} is not supported: send the input (and previous_response_id for a follow-up)",
                )
        if self.previous_response_id is not None and not self.previous_response_id:
            raise field_error("previous_response_id", "must be a response id, got an empty string")
        return self

    @property
    def text_format(self) -> TextFormatText | TextFormatJsonObject | TextFormatJsonSchema | None:
        return None if self.text is None else self.text.format
