"""Hermes / Qwen tool calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per
call, after any text (NousResearch's Hermes format, which Qwen 2.5 / 3 and SmolLM3 templates use)."""

from __future__ import annotations

from pagedgen.server.tool_parsers.base import ToolCallFormat

HERMES = ToolCallFormat(
    name="hermes",
    trigger="<tool_call>",
    arguments_key="arguments",
    close_words=("</tool_call>",),
    next_call="<tool_call>",
    grammar_open="\n",
    grammar_close="\n</tool_call>",
    grammar_next="\n<tool_call>\n",
)
TEMPLATE_MARKERS = ("<tool_call>",)
INSTRUCTIONS = (
    "To call a function, reply with a JSON object holding its name and arguments inside "
    "<tool_call></tool_call> tags, one block per call:\n"
    '<tool_call>\n{"name": "<function name>", "arguments": <arguments as a JSON object>}\n</tool_call>\n'
    "Otherwise, answer in plain text."
)
