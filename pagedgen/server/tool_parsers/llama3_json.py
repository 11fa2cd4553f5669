"""Llama 3.1 / 3.2 JSON tool calls: the reply is ``{"name": ..., "parameters": {...}}`` (calls separated by
``; ``), optionally after ``<|python_tag|>``; a reply that does not start so is text."""

from __future__ import annotations

from pagedgen.server.tool_parsers.base import ToolCallFormat

LLAMA3_JSON = ToolCallFormat(
    name="llama3_json",
    trigger="<|python_tag|>",
    arguments_key="parameters",
    at_start=True,
    next_call=";",
    grammar_next="; ",
)
TEMPLATE_MARKERS = ("<|python_tag|>", '"parameters": dictionary of argument name')
INSTRUCTIONS = (
    "To call a function, reply with nothing but a JSON object in the format "
    '{"name": "<function name>", "parameters": <arguments as a JSON object>} (several calls separated by '
    '"; "). Otherwise, answer in plain text.'
)
