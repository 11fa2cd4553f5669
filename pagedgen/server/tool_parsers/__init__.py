"""Tool-call parsers for ``tool_choice: "auto"``: one module per format, chosen by ``--tool-call-parser`` or
detected from the chat template (:func:`detect_format`).

A format (:class:`ToolCallFormat`) says how a model family writes calls; :class:`ToolCallParser` finds them
in the reply, whole or streamed; :func:`tool_call_grammar` builds the llguidance constraint that leaves
text free and makes every call, once opened, name a tool and carry arguments valid for its schema.
"""

from __future__ import annotations

from pagedgen.server.tool_parsers import hermes, llama3_json, mistral
from pagedgen.server.tool_parsers.base import (
    CallDelta,
    ParsedCall,
    ParserDelta,
    ToolCallFormat,
    ToolCallParser,
)
from pagedgen.server.tool_parsers.grammar import tool_call_grammar

_MODULES = {"hermes": hermes, "llama3_json": llama3_json, "mistral": mistral}
FORMATS: dict[str, ToolCallFormat] = {
    "hermes": hermes.HERMES,
    "llama3_json": llama3_json.LLAMA3_JSON,
    "mistral": mistral.MISTRAL,
}
TOOL_CALL_PARSERS = tuple(FORMATS)  # the names --tool-call-parser accepts


def detect_format(template: str) -> ToolCallFormat | None:
    """The format a chat template's text writes tool calls in, if it shows one pagedgen knows."""
    for name, module in _MODULES.items():
        if any(marker in template for marker in module.TEMPLATE_MARKERS):
            return FORMATS[name]
    return None


def instructions(fmt: ToolCallFormat) -> str:
    """How the fallback system prompt tells the model to write a call in ``fmt``."""
    return _MODULES[fmt.name].INSTRUCTIONS


__all__ = [
    "FORMATS",
    "TOOL_CALL_PARSERS",
    "CallDelta",
    "ParsedCall",
    "ParserDelta",
    "ToolCallFormat",
    "ToolCallParser",
    "detect_format",
    "instructions",
    "tool_call_grammar",
]
