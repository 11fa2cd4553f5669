"""``tool_choice: "auto"`` (and tools without ``tool_choice``): the model answers in text or calls tools.

What vLLM serves with ``--enable-auto-tool-choice --tool-call-parser NAME``, on by default here, but every
call held to a tool and its schema: :func:`auto_tool_calls` picks the format (the flag, else the chat
template's), the prompt (the template's ``tools``, else a fallback system prompt), the constraint
(:mod:`pagedgen.server.tool_parsers.grammar`) and the decoding of a request. docs/server.md, "Automatic tool
calls", has the rules and why.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from pagedgen.server.guard import ApiError
from pagedgen.server.tool_parsers import (
    FORMATS,
    TOOL_CALL_PARSERS,
    ToolCallFormat,
    ToolCallParser,
    detect_format,
    instructions,
    tool_call_grammar,
)
from pagedgen.server.tool_parsers.hermes import HERMES
from pagedgen.server.tools import parameters_schema

if TYPE_CHECKING:
    from pagedgen.core.json_value import JsonObject, JsonValue
    from pagedgen.llm import TextTokenizer
    from pagedgen.server.protocol import ChatCompletionRequest

DISABLED_MESSAGE = (
    '"auto" tool choice (the default when tools are given) is off on this server (started with '
    '--no-enable-auto-tool-choice): set tool_choice to "none", "required" or a named function'
)


@dataclass(frozen=True, slots=True)
class AutoToolSettings:
    """The server's choice: ``enabled`` (``--enable-auto-tool-choice``, default on) and ``parser``
    (``--tool-call-parser``; None: detected from the chat template)."""

    enabled: bool = True
    parser: str | None = None

    def __post_init__(self) -> None:
        if self.parser is not None and self.parser not in TOOL_CALL_PARSERS:
            names = ", ".join(TOOL_CALL_PARSERS)
            raise ValueError(f"tool_call_parser must be one of {names}, got {self.parser!r}")


@dataclass(frozen=True, slots=True)
class AutoToolCalls:
    """One request's automatic tool calls: its format, constraint, prompt addition and decoding."""

    format: ToolCallFormat
    grammar: str
    system_prompt: str | None  # the fallback prompt, None when the template renders the tools
    keep_special_tokens: bool  # the trigger is a special token: decode the reply with it

    def prompt_messages(self, messages: Sequence[Mapping[str, JsonValue]]) -> list[JsonObject]:
        """The conversation the template renders: with the fallback prompt in its system message."""
        messages = [dict(message) for message in messages]
        if self.system_prompt is None:
            return messages
        if messages and messages[0]["role"] == "system":
            messages[0]["content"] = f"{messages[0]['content']}\n\n{self.system_prompt}"
            return messages
        return [{"role": "system", "content": self.system_prompt}, *messages]

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self.format)


def auto_tool_calls(
    body: ChatCompletionRequest, tokenizer: TextTokenizer, settings: AutoToolSettings
) -> AutoToolCalls | None:
    """The plan of a chat request with ``tools`` and ``tool_choice`` ``"auto"`` or absent, attached to the
    request (its constraint, and special tokens kept where the trigger is one); None for any other request.
    A refusal is an :class:`ApiError` 400 naming ``tool_choice``."""
    if body.tools is None or body.tool_choice not in (None, "auto"):
        return None
    if not settings.enabled:
        raise ApiError(400, DISABLED_MESSAGE, param="tool_choice")
    template = getattr(tokenizer, "chat_template", None) or ""
    renders = renders_tools(template)
    fmt = _format(settings, template, renders)
    trigger_token = special_token_id(tokenizer, fmt.trigger)
    tools = [(tool.function.name, parameters_schema(tool.function.parameters)) for tool in body.tools]
    plan = AutoToolCalls(
        fmt,
        tool_call_grammar(fmt, tools, body.parallel_tool_calls, trigger_token),
        None if renders else fallback_system_prompt(fmt, body.template_tools or []),
        trigger_token is not None,
    )
    body.use_auto_tool_grammar(plan.grammar)
    if plan.keep_special_tokens:
        body.skip_special_tokens = False
    return plan


def tokenized_messages(
    messages: list[JsonObject],
    tools: list[JsonObject] | None,
    tokenizer: TextTokenizer,
    settings: AutoToolSettings,
) -> list[JsonObject]:
    """The messages ``/tokenize`` renders for a chat with ``tools`` (no ``tool_choice`` there: the chat
    route's default, ``"auto"``), so its count is the chat's ``usage.prompt_tokens``: with the fallback
    prompt where the template has no ``tools`` and automatic calls are on."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if tools is None or not settings.enabled or renders_tools(template):
        return messages
    fmt = FORMATS[settings.parser] if settings.parser is not None else HERMES
    plan = AutoToolCalls(fmt, "", fallback_system_prompt(fmt, tools), keep_special_tokens=False)
    return plan.prompt_messages(messages)


def _format(settings: AutoToolSettings, template: str, renders: bool) -> ToolCallFormat:
    if settings.parser is not None:
        return FORMATS[settings.parser]
    if not renders:
        return HERMES
    fmt = detect_format(template)
    if fmt is None:
        raise ApiError(
            400,
            "the chat template renders tools in a format pagedgen cannot detect: start the server with "
            f"--tool-call-parser ({', '.join(TOOL_CALL_PARSERS)}) for automatic tool calls",
            param="tool_choice",
        )
    return fmt


def fallback_system_prompt(fmt: ToolCallFormat, tools: Sequence[Mapping[str, JsonValue]]) -> str:
    """The tools, one JSON object a line, and how to call them, for a template without ``tools``."""
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return f"You may call these functions:\n<tools>\n{listing}\n</tools>\n\n{instructions(fmt)}"


@lru_cache(maxsize=16)
def renders_tools(template: str) -> bool:
    """Whether a chat template reads the ``tools`` variable (a template that fails to parse: no; it is
    refused when the chat is rendered)."""
    if not template:
        return False
    import jinja2
    from jinja2 import meta

    try:
        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
        return "tools" in meta.find_undeclared_variables(env.parse(template))
    except jinja2.TemplateError:
        return False


def special_token_id(tokenizer: TextTokenizer, text: str) -> int | None:
    """The id of the special token spelled ``text`` in ``tokenizer``, None when it is text there."""
    encode = getattr(tokenizer, "encode", None)
    if encode is None or not hasattr(tokenizer, "render_chat") or not text:
        return None  # a tokenizer without special-token parsing (the synthetic codec)
    ids = encode(text)
    return ids[0] if len(ids) == 1 and ids != encode(text, parse_special=False) else None
