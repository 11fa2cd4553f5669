"""Forced tool calls, as vLLM serves them without a tool-call parser: a JSON schema in, ``tool_calls`` out.

With ``tool_choice`` naming a function, the output is constrained to that function's ``parameters`` schema
and is the call's ``arguments`` text as generated. With ``tool_choice="required"``, the output is constrained
to a JSON array of at least one ``{"name": <a tool's name>, "parameters": <that tool's arguments>}``
(one ``anyOf`` branch per tool) and parsed into one call per element. ``"auto"`` would need a parser that
finds tool calls in free text, which pagedgen does not have (vLLM refuses it the same way unless it runs
with ``--enable-auto-tool-choice``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedgen.errors import SamplingOptionsError

if TYPE_CHECKING:
    from pagedgen.core.json_value import JsonObject, JsonValue

# A function without parameters takes none: its arguments are exactly "{}".
NO_PARAMETERS: JsonObject = {"type": "object", "properties": {}, "additionalProperties": False}
_DEFINITION_KEYS = ("$defs", "definitions")  # where a schema keeps the subschemas its "#/..." refs name


@dataclass(frozen=True, slots=True)
class ForcedToolCalls:
    """How a chat turn's output becomes tool calls: ``function`` is the named function, or None for
    ``"required"`` (a list of calls of any of the tools)."""

    function: str | None

    @property
    def required(self) -> bool:
        return self.function is None


def parameters_schema(parameters: Mapping[str, JsonValue] | None) -> JsonObject:
    """The schema a function's arguments follow; missing or empty ``parameters`` mean no arguments."""
    return dict(parameters) if parameters else dict(NO_PARAMETERS)


def required_schema(
    tools: Sequence[tuple[str, Mapping[str, JsonValue] | None]], parallel: bool
) -> JsonObject:
    """The schema of ``tool_choice="required"`` output over ``(name, parameters)`` pairs (vLLM's shape).

    Each tool's ``$defs`` / ``definitions`` move to the root, where its ``#/$defs/...`` refs resolve once
    its schema is nested under ``items.anyOf``; two tools defining one name differently are refused
    (``SamplingOptionsError`` naming the later tool). ``parallel=False`` allows exactly one call.
    """
    branches = []
    hoisted: dict[str, JsonObject] = {}
    for index, (name, parameters) in enumerate(tools):
        schema = parameters_schema(parameters)
        for key in _DEFINITION_KEYS:
            definitions = schema.pop(key, None)
            if definitions is None:
                continue
            field = f"tools[{index}].function.parameters"
            if not isinstance(definitions, Mapping):
                raise SamplingOptionsError(f"{field}.{key} must be an object", field)
            merged = hoisted.setdefault(key, {})
            for def_name, definition in definitions.items():
                if def_name in merged and merged[def_name] != definition:
                    message = f"{field}: {key}/{def_name} differs from another tool's definition of it"
                    raise SamplingOptionsError(message, field)
                merged[def_name] = definition
        branches.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    array: JsonObject = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel:
        array["maxItems"] = 1
    return {**array, **hoisted}


def parse_required_calls(text: str) -> list[tuple[str, str]] | None:
    """``(name, arguments JSON text)`` of each call in ``"required"`` output; None when it does not parse
    (the turn was cut short by its token limit or a stop string)."""
    try:
        calls = json.loads(text)
    except ValueError:
        return None
    if not isinstance(calls, list) or not calls:
        return None
    parsed = []
    for call in calls:
        if not (isinstance(call, dict) and isinstance(call.get("name"), str) and "parameters" in call):
            return None
        arguments = json.dumps(call["parameters"], ensure_ascii=False)
        parsed.append((call["name"], arguments))
    return parsed


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(call_id: str, name: str, arguments: str) -> JsonObject:
    """One entry of ``message.tool_calls``."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
