"""The constraint of an automatic tool call: free text, until the model opens a call; then a valid call.

The text is free up to the format's trigger (a lazy lexeme, or the special token the tokenizer has for
it); from there every character is the format's: a call naming a tool with arguments valid for its
schema, then EOS or the next call. So an automatic call always parses and validates, and a text reply is
not constrained. docs/server.md, "Automatic tool calls" ("The constraint"), has the details.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from pagedgen.guidance.spec import JSON_DEFAULTS
from pagedgen.server.tool_parsers.base import ToolCallFormat

if TYPE_CHECKING:
    from pagedgen.core.json_value import JsonObject, JsonValue

FREE_TEXT = r"/(.|\n)*/"
# A Llama 3 reply that is text: empty, whitespace, or text whose first visible character is not "{".
NOT_A_CALL = r"/(\s*[^\s{](.|\n)*)?\s*/"


def tool_call_grammar(
    fmt: ToolCallFormat,
    tools: Sequence[tuple[str, Mapping[str, JsonValue]]],
    parallel: bool,
    trigger_token: int | None,
) -> str:
    """The Lark grammar (llguidance's dialect) over ``(name, parameters schema)`` pairs; ``trigger_token``
    is the id of the special token the trigger is in this tokenizer (None: the trigger is text). The
    arguments follow each schema as :mod:`pagedgen.guidance.spec` writes JSON (``json.dumps``'s separators,
    no free whitespace) unless the schema carries its own ``x-guidance`` options."""
    calls = " | ".join(f"call_{index}" for index in range(len(tools)))
    repeat = f" ({_literal(fmt.grammar_next)} one)*" if parallel else ""
    body = f"{_literal(fmt.grammar_open)} one{repeat} {_literal(fmt.grammar_end)}".strip()
    lines = ["%llguidance {}", "start: TEXT | calls"]
    if fmt.at_start:
        head = f"<[{trigger_token}]>? " if trigger_token is not None else ""
        lines += [f"TEXT: {NOT_A_CALL}", f"calls: {head}{body}"]
    elif trigger_token is not None:
        lines += [f"TEXT: {FREE_TEXT}", f"calls: TEXT <[{trigger_token}]> {body}"]
    else:
        lines += [f"TEXT: {FREE_TEXT}", f"head[lazy]: TEXT {_literal(fmt.trigger)}", f"calls: head {body}"]
    lines.append(f"one: {calls}")
    for index, (name, schema) in enumerate(tools):
        opening = f'{{"name": "{name}", "{fmt.arguments_key}": '
        lines.append(
            f'call_{index}: {_literal(opening)} args_{index} "}}" {_literal(fmt.grammar_close)}'.rstrip()
        )
        lines.append(f"args_{index}: %json {json.dumps(_with_json_options(schema))}")
    return "\n".join(lines) + "\n"


def _literal(text: str) -> str:
    """A Lark string literal (JSON's escapes are Lark's), or nothing for empty text."""
    return json.dumps(text) if text else ""


def _with_json_options(schema: Mapping[str, JsonValue]) -> JsonObject:
    if "x-guidance" in schema:
        return dict(schema)
    return {**schema, "x-guidance": JSON_DEFAULTS}
