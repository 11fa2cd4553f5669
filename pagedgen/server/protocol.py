"""The OpenAI wire format: pydantic models for request bodies, strict about types, lenient about names.

An unknown top-level field (or message key) is ignored and logged once, as vLLM does; the objects that
choose what is generated stay strict, and a lone UTF-16 surrogate anywhere is a 400 naming its path. The
sampling fields' defaults and types are :class:`SamplingParams`' own (``to_sampling_params`` passes them
on by name), so the engine's one rule set validates them. docs/server.md, "Request parameters" and
"Errors", has the rules.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pagedgen.errors import SamplingOptionsError
from pagedgen.sampling.params import SamplingParams, StructuredOutputsParams
from pagedgen.server.tools import ForcedToolCalls, parameters_schema, required_schema

if TYPE_CHECKING:
    from pagedgen.core.json_value import JsonObject, JsonValue

log = logging.getLogger("pagedgen.server")

PositiveInt = Annotated[int, Field(ge=1)]
MAX_CHOICES = 16  # a request's largest n (the server also needs n <= --max-batch-size)
MAX_TOKEN_ID_DIGITS = 9  # a logit_bias key longer than this names no token of any vocabulary
_SURROGATE = re.compile("[\ud800-\udfff]")


def surrogate_path(value: object, path: str = "") -> str | None:
    """The path (``messages[0].content``) of the first string or key in ``value`` holding a lone
    surrogate, else None; ``path`` is the path of ``value`` itself."""
    if isinstance(value, str):
        return None if value.isascii() or _SURROGATE.search(value) is None else (path or "body")
    if isinstance(value, dict):
        for key, item in value.items():
            inner = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and surrogate_path(key) is not None:
                return path or "body"
            found = surrogate_path(item, inner)
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = surrogate_path(item, f"{path}[{index}]")
            if found is not None:
                return found
    return None


def field_error(param: str, detail: str) -> PydanticCustomError:
    """A validation error of a whole request that names the field at fault (``param`` of the 400)."""
    return PydanticCustomError("field_error", "{param}: {detail}", {"param": param, "detail": detail})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class IgnoredFields:
    """The names of ignored fields already logged, process-wide (vLLM's "logged once" rule); bounded, so a
    client inventing names cannot grow it (past the bound, new names are ignored unlogged)."""

    MAX_NAMES = 1024
    MAX_NAME_CHARS = 64

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def note(self, names: list[str]) -> None:
        """Log the names not logged before (one warning per request that brings new ones)."""
        fresh = []
        with self._lock:
            for name in names:
                name = name[: self.MAX_NAME_CHARS]
                if name not in self._seen and len(self._seen) < self.MAX_NAMES:
                    self._seen.add(name)
                    fresh.append(name)
        if fresh:
            names = "{" + ", ".join(repr(name) for name in sorted(fresh)) + "}"  # a set, in a stable order
            log.warning("The following fields were present in the request but ignored: %s", names)

    def seen(self, name: str) -> bool:
        with self._lock:
            return name in self._seen


IGNORED_FIELDS = IgnoredFields()


class _Lenient(BaseModel):
    """A model whose unknown keys are ignored (and logged once per name as ``<where>.<key>``)."""

    model_config = ConfigDict(extra="allow", strict=True)
    where: ClassVar[str] = ""  # the body path of the object, for the log ("messages[]"; "" at the top)

    @model_validator(mode="after")
    def _drop_unknown(self) -> _Lenient:
        extra = self.__pydantic_extra__
        if extra:
            IGNORED_FIELDS.note([f"{self.where}.{key}" if self.where else str(key) for key in extra])
            extra.clear()
        return self


class _Body(_Lenient):
    """A request body: lenient about names, and no lone surrogate anywhere in it."""

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        path = surrogate_path(data)
        if path is not None:
            raise PydanticCustomError(
                "lone_surrogate",
                "{param}: the text holds a lone UTF-16 surrogate (e.g. \\ud800), which is not valid Unicode",
                {"param": path},
            )
        return data


class StreamOptions(_Lenient):
    where = "stream_options"

    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Lenient):
    where = "messages[].tool_calls[].function"
    name: str
    arguments: str


class ToolCall(_Lenient):
    """A tool call of an earlier assistant message, sent back with the conversation."""

    where = "messages[].tool_calls[]"

    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Lenient):
    where = "messages[]"
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant message's calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def as_template_message(self) -> JsonObject:
        """The ``{"role", "content"}`` dict a chat template expects (``developer`` -> ``system``), with
        ``tool_calls`` / ``tool_call_id`` when the message has them (a template may ignore them)."""
        role = "system" if self.role == "developer" else self.role
        if self.content is None:
            content = ""
        elif isinstance(self.content, str):
            content = self.content
        else:
            content = "".join(part.text for part in self.content)
        message: JsonObject = {"role": role, "content": content}
        if self.tool_calls is not None:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchemaSpec(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # accepted; the output always follows the schema as llguidance reads it


class JsonSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs`` request field; exactly one constraint (checked when compiled)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    @property
    def given(self) -> str:
        """The wire name of the (first) constraint field that is set, "" if none."""
        values = (self.json_, self.regex, self.choice, self.grammar, self.json_object)
        names = ("json", "regex", "choice", "grammar", "json_object")
        return next((name for name, value in zip(names, values, strict=True) if value is not None), "")

    def params(self) -> StructuredOutputsParams:
        """Raises :class:`SamplingOptionsError` naming ``structured_outputs.<field>``."""
        return StructuredOutputsParams(
            json=self.json_,
            regex=self.regex,
            choice=self.choice,
            grammar=self.grammar,
            json_object=self.json_object,
        )


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


# The defaults of the sampling fields a body shares with SamplingParams: the one definition's.
_DEFAULT: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
# The SamplingParams fields a body writes in its own shape (converted by ``_sampling_params``); every other
# field of SamplingParams is a body field of the same name, type and default, passed on as it is.
WIRE_SHAPED = frozenset({"max_tokens", "top_k", "stop", "logit_bias", "logprobs", "structured_outputs"})


class _SamplingFields(_Body):
    """The sampling parameters shared by both routes: OpenAI's, plus vLLM's extensions."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: PositiveInt = 1
    max_tokens: int | None = None
    temperature: Annotated[float, Field(le=2.0)] = _DEFAULT["temperature"]  # OpenAI's cap (not the engine's)
    top_p: float = _DEFAULT["top_p"]
    top_k: int = _DEFAULT["top_k"]  # vLLM's -1 also disables top-k
    min_p: float = _DEFAULT["min_p"]
    seed: int | None = _DEFAULT["seed"]
    stop: str | list[str] | None = None
    presence_penalty: float = _DEFAULT["presence_penalty"]
    frequency_penalty: float = _DEFAULT["frequency_penalty"]
    repetition_penalty: float = _DEFAULT["repetition_penalty"]
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = _DEFAULT["ignore_eos"]
    min_tokens: int = _DEFAULT["min_tokens"]
    user: str | None = None  # accepted, not used
    skip_special_tokens: bool = True  # False: special tokens the model generates stay in the text
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    @field_validator("n")
    @classmethod
    def _at_most_max_choices(cls, n: int) -> int:
        if n > MAX_CHOICES:
            raise ValueError(f"n={n} is more choices than one request may ask for (at most {MAX_CHOICES})")
        return n

    @model_validator(mode="after")
    def _check_stream_options(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def wire_name(self, field: str | None) -> str | None:
        """The body's name of a :class:`SamplingParams` field (they differ only where OpenAI's do)."""
        return field

    def _logit_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        bad = [
            key
            for key in self.logit_bias
            if not (key.isascii() and key.isdigit() and len(key) <= MAX_TOKEN_ID_DIGITS)
        ]
        if bad:
            raise SamplingOptionsError(
                f"logit_bias keys must be token ids (decimal strings of at most {MAX_TOKEN_ID_DIGITS} "
                f"digits), got {bad[0][:40]!r}"
                + (f" ({len(bad[0])} characters)" if len(bad[0]) > 40 else ""),
                "logit_bias",
            )
        bias: dict[int, float] = {}
        keys: dict[int, str] = {}
        for key, value in self.logit_bias.items():
            token = int(key)
            if token in keys:
                raise SamplingOptionsError(
                    f"logit_bias keys {keys[token]!r} and {key!r} name the same token id {token}",
                    "logit_bias",
                )
            keys[token] = key
            bias[token] = value
        return bias

    @property
    def _formatted(self) -> bool:
        """Whether ``response_format`` constrains the output (anything but ``text``)."""
        return self.response_format is not None and self.response_format.type != "text"

    @property
    def constrains_output(self) -> bool:
        """True when the request asks for an output constraint (compiling it may take a while)."""
        return self._formatted or self.structured_outputs is not None

    @property
    def constraint_param(self) -> str:
        """The field whose constraint the request carries (named when the model's tokenizer or a parser
        limit refuses it): ``structured_outputs.regex``, ``response_format.json_schema.schema``, ..."""
        if self.structured_outputs is not None:
            given = self.structured_outputs.given
            return f"structured_outputs.{given}" if given else "structured_outputs"
        if isinstance(self.response_format, JsonSchemaFormat):
            return "response_format.json_schema.schema"
        return "response_format"

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The output constraint of ``response_format`` or ``structured_outputs`` (at most one may be
        given); raises :class:`SamplingOptionsError` naming the field that is wrong."""
        if self._formatted and self.structured_outputs is not None:
            raise SamplingOptionsError(
                "response_format and structured_outputs both constrain the output; send one of them",
                "structured_outputs",
            )
        if self.structured_outputs is not None:
            return self.structured_outputs.params()
        if isinstance(self.response_format, JsonObjectFormat):
            return StructuredOutputsParams(json_object=True)
        if isinstance(self.response_format, JsonSchemaFormat):
            try:
                return StructuredOutputsParams(json=self.response_format.json_schema.json_schema)
            except SamplingOptionsError as exc:
                message = str(exc).replace("structured_outputs.json:", "response_format.json_schema.schema:")
                raise SamplingOptionsError(message, "response_format.json_schema.schema") from None
        return None

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises :class:`SamplingOptionsError` naming the first bad field (the engine's one rule set)."""
        same = {name: getattr(self, name) for name in _DEFAULT if name not in WIRE_SHAPED}
        return SamplingParams(
            **same,
            max_tokens=max_tokens,
            top_k=0 if self.top_k == -1 else self.top_k,
            stop=self._stop_strings(),
            logit_bias=self._logit_bias(),
            logprobs=logprobs,
            structured_outputs=self.structured_outputs_params(),
        )


# Template variables a client may not set through ``chat_template_kwargs``: pagedgen sets them itself.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
TemplateValue = bool | int | float | str | None


class ChatTemplateFields(BaseModel):
    """vLLM's chat template options, shared by the chat route and ``/tokenize``.

    ``add_generation_prompt`` (default true) ends the prompt with the template's opening of an assistant
    turn; ``continue_final_message`` instead leaves the last message, an assistant's, open for the model
    to continue (both true is a 400). ``chat_template_kwargs`` are extra template variables
    (``enable_thinking``): scalars only, and not the names pagedgen sets itself."""

    chat_template_kwargs: dict[str, TemplateValue] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(
        cls, kwargs: dict[str, TemplateValue] | None
    ) -> dict[str, TemplateValue] | None:
        for key in kwargs or {}:
            if key in RESERVED_TEMPLATE_VARIABLES or key.endswith("_token"):
                raise ValueError(f"{key!r} is set by the server and cannot be passed to the chat template")
        return kwargs

    @model_validator(mode="after")
    def _check_continue(self) -> ChatTemplateFields:
        if self.continue_final_message and self.add_generation_prompt:
            raise field_error(
                "continue_final_message",
                "it continues the last message, so add_generation_prompt must be false (it defaults to true)",
            )
        if self.continue_final_message:
            last = getattr(self, "messages", None)
            if last and last[-1].role != "assistant":
                raise field_error(
                    "continue_final_message", "the last message must be an assistant's (it is continued)"
                )
        return self

    def template_options(self) -> JsonObject:
        """The keyword arguments of :func:`pagedgen.server.prompting.chat_prompt_ids`."""
        return {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "template_kwargs": dict(self.chat_template_kwargs or {}),
        }


class ChatCompletionRequest(ChatTemplateFields, _SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: Annotated[list[Tool], Field(min_length=1)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True  # False: "required" makes exactly one call, "auto" at most one
    _auto_tool_grammar: str | None = PrivateAttr(None)  # "auto": set by the route (server.auto_tools)

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise field_error("max_completion_tokens", "disagrees with max_tokens; send one of them")
        return self

    @property
    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        return self._sampling_params(max_tokens, self.requested_logprobs)

    @property
    def forced_tool_calls(self) -> ForcedToolCalls | None:
        """How the output becomes tool calls, or None when it is a plain message (no tools, or "none")."""
        if self.tools is None or self.tool_choice in (None, "none", "auto"):
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return ForcedToolCalls(self.tool_choice.function.name)
        return ForcedToolCalls(None)

    def use_auto_tool_grammar(self, grammar: str) -> None:
        """Serve ``tool_choice: "auto"`` with this constraint (:mod:`pagedgen.server.auto_tools` builds it:
        it depends on the server's tool-call format and the model's tokenizer)."""
        self._auto_tool_grammar = grammar

    @property
    def template_tools(self) -> list[JsonObject] | None:
        """The tools the chat template sees: none when ``tool_choice`` is ``"none"`` (they are ignored)."""
        if self.tools is None or self.tool_choice == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    @property
    def constrains_output(self) -> bool:
        forced = self.forced_tool_calls is not None or self._auto_tool_grammar is not None
        return super().constrains_output or forced

    @property
    def constraint_param(self) -> str:
        """A forced call's constraint is its tool's ``parameters`` (one tool, or the named one); the
        ``"required"`` array over several tools is ``tools``."""
        forced = self.forced_tool_calls
        if self._auto_tool_grammar is not None and forced is None:
            return "tools"
        if forced is None or self.tools is None:
            return super().constraint_param
        names = [tool.function.name for tool in self.tools]
        if forced.function in names:
            return f"tools[{names.index(forced.function)}].function.parameters"
        return "tools[0].function.parameters" if len(names) == 1 else "tools"

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        tool_constraint = self._tool_constraint()
        other = super().structured_outputs_params()
        if tool_constraint is not None and other is not None:
            raise SamplingOptionsError(
                f"tool_choice and {super().constraint_param} both constrain the output; send one of them",
                "tool_choice",
            )
        return tool_constraint or other

    def _tool_constraint(self) -> StructuredOutputsParams | None:
        """The constraint of a forced or automatic tool call; raises :class:`SamplingOptionsError` naming the
        field."""
        choice = self.tool_choice
        if choice == "none" or (choice is None and self.tools is None):
            return None
        if self.tools is None:
            raise SamplingOptionsError("tool_choice is set but no tools are given", "tool_choice")
        names = [tool.function.name for tool in self.tools]
        for index, name in enumerate(names):
            if name in names[:index]:
                raise SamplingOptionsError(f"two tools are named {name!r}", f"tools[{index}].function.name")
        for index, tool in enumerate(self.tools):
            field = f"tools[{index}].function.parameters"
            try:
                StructuredOutputsParams(json=parameters_schema(tool.function.parameters))
            except SamplingOptionsError as exc:
                message = str(exc).replace("structured_outputs.json:", f"{field}:")
                raise SamplingOptionsError(message, field) from None
        if choice in (None, "auto"):
            return self._auto_tool_constraint()
        if isinstance(choice, NamedToolChoice):
            by_name = {tool.function.name: tool.function for tool in self.tools}
            function = by_name.get(choice.function.name)
            if function is None:
                raise SamplingOptionsError(
                    f"tool_choice names function {choice.function.name!r}, which is not among the tools "
                    f"({', '.join(sorted(by_name))})",
                    "tool_choice",
                )
            return StructuredOutputsParams(json=parameters_schema(function.parameters))
        pairs = [(tool.function.name, tool.function.parameters) for tool in self.tools]
        try:
            return StructuredOutputsParams(json=required_schema(pairs, self.parallel_tool_calls))
        except SamplingOptionsError as exc:
            if exc.field is not None and exc.field.startswith("tools["):
                raise
            message = str(exc).replace("structured_outputs.json:", "tools:")
            raise SamplingOptionsError(message, "tools") from None

    def _auto_tool_constraint(self) -> StructuredOutputsParams:
        if self._auto_tool_grammar is None:
            raise SamplingOptionsError(
                'tool_choice "auto" (the default when tools are given) needs the tool-call parser of a '
                "server (pagedgen.server.auto_tools), which this request was not given: set tool_choice to "
                '"required" or to a named function',
                "tool_choice",
            )
        try:
            return StructuredOutputsParams(grammar=self._auto_tool_grammar)
        except SamplingOptionsError as exc:
            message = str(exc).replace("structured_outputs.grammar:", "tools:")
            raise SamplingOptionsError(message, "tools") from None

    def wire_name(self, field: str | None) -> str | None:
        if field == "logprobs":
            return "top_logprobs"
        if field == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return field


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_SamplingFields):
    """A completion; ``prompt`` is a string, token ids, or a batch of either (one choice per prompt, in
    order). ``echo`` puts each prompt's text before its choice's text."""

    prompt: (
        str
        | TokenIds
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    logprobs: int | None = None
    echo: bool = False

    @model_validator(mode="before")
    @classmethod
    def _no_tools(cls, data: Any) -> Any:
        """Tools are known to the chat route: ignoring them here would drop the constraint they ask for."""
        for field in ("tools", "tool_choice"):
            if isinstance(data, dict) and field in data:
                raise field_error(field, "tools apply to /v1/chat/completions; a completion calls none")
        return data

    @model_validator(mode="after")
    def _check_echo(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            raise field_error(
                "echo",
                "with logprobs it would need the prompt's logprobs, which pagedgen does not compute; send "
                "echo or logprobs",
            )
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch: each prompt is a string or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]  # type: ignore[list-item]
        return list(prompt)  # type: ignore[arg-type]

    @property
    def requested_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def requested_max_tokens(self) -> int | None:
        # The OpenAI completions API defaults to 16 tokens (chat has no such default).
        return 16 if self.max_tokens is None else self.max_tokens

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        return self._sampling_params(max_tokens, self.requested_logprobs)


class TokenizeRequest(ChatTemplateFields, _Body):
    """vLLM's ``/tokenize``: a ``prompt`` (with the tokenizer's sequence tokens unless
    ``add_special_tokens`` is false) or ``messages`` (through the chat template, as the chat route)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: Annotated[list[Tool], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise field_error("prompt", "send either prompt or messages")
        if self.messages is not None and self.add_special_tokens:
            raise field_error(
                "add_special_tokens", "applies to a prompt: the chat template writes a chat's special tokens"
            )
        if self.prompt is not None and self.tools is not None:
            raise field_error("tools", "tools apply to messages, not to a prompt")
        return self


class DetokenizeRequest(_Body):
    """vLLM's ``/detokenize``: the text of token ids (special tokens kept unless ``skip_special_tokens``)."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]
    skip_special_tokens: bool = False


# The body of either sampling route (the Responses API's is translated into a chat completion's).
RequestBody = ChatCompletionRequest | CompletionRequest


NAMED_ERRORS = ("lone_surrogate", "field_error")  # validation errors whose message and ctx name the field
_PYDANTIC_TAG = re.compile(r"[\[\](),-]|^(str|int|float|bool|dict|list|none)$|^[A-Z]")  # a union member's tag


def error_param(error: Mapping[str, JsonValue], body: object) -> str | None:
    """The body path of a validation error (``messages[0].content``).

    pydantic's ``loc`` also names union members (``str``, ``list[TextPart]``) and discriminator values
    (``json_schema``); walking the request body along it keeps only the segments that are its keys and
    indexes (and a last, missing field's name). A discriminator value can also be a key of the object
    (``response_format: {"type": "json_schema", "json_schema": ...}``): for an unknown key, the walk that
    skips the value and reaches the key wins (``response_format.strictly``)."""
    ctx = error.get("ctx") or {}
    if error.get("type") in NAMED_ERRORS and isinstance(ctx.get("param"), str):
        return ctx["param"]
    loc = [part for part in error.get("loc", ()) if part != "body"]
    path, reached = _body_path(loc, body, skip_tags=False)
    if error.get("type") == "extra_forbidden" and not reached:
        tagless, reached = _body_path(loc, body, skip_tags=True)
        if reached:
            return tagless
    return path


def _body_path(loc: list[str | int], body: object, *, skip_tags: bool) -> tuple[str | None, bool]:
    """The body path along ``loc``, and whether its last segment is in the body."""
    path, node, present = "", body, False
    for index, part in enumerate(loc):
        if skip_tags and isinstance(node, dict) and node.get("type") == part and index < len(loc) - 1:
            continue  # the discriminator's value, not a key
        present = isinstance(node, dict) and part in node
        present = present or (isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node))
        if not present and (index < len(loc) - 1 or _PYDANTIC_TAG.search(str(part))):
            continue  # a union member's or a discriminator's tag
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
        node = node[part] if present else None
    return path or None, present


def new_id(prefix: str, separator: str = "-") -> str:
    """A fresh OpenAI-style object id (``chatcmpl-…``, ``cmpl-…``; the Responses API's ``resp_…``)."""
    return f"{prefix}{separator}{uuid.uuid4().hex}"
