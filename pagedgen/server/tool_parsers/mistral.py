"""Mistral tool calls: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``, one JSON list of calls after
the ``[TOOL_CALLS]`` token (Mistral 7B v0.3, Mixtral 8x22B, Mistral Nemo / Small)."""

from __future__ import annotations

from pagedgen.server.tool_parsers.base import ToolCallFormat

MISTRAL = ToolCallFormat(
    name="mistral",
    trigger="[TOOL_CALLS]",
    arguments_key="arguments",
    open_words=("[",),
    next_call=",",
    end_word="]",
    grammar_open=" [",
    grammar_next=", ",
    grammar_end="]",
)
TEMPLATE_MARKERS = ("[TOOL_CALLS]",)
INSTRUCTIONS = (
    "To call functions, reply with [TOOL_CALLS] followed by a JSON list of calls: "
    '[TOOL_CALLS] [{"name": "<function name>", "arguments": <arguments as a JSON object>}]. '
    "Otherwise, answer in plain text."
)
