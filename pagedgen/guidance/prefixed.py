"""A constraint that starts after free text: a reasoning model's ``<think> ... </think>``, then the answer.

The constraint is applied from the first token by a grammar whose prefix is free text up to the end tag,
not switched on when the tag is seen: the engine samples a step's tokens before any text is looked at, so
only the grammar is exact. How the grammar is built: docs/engine.md, "A constraint after free text".
"""

from __future__ import annotations

import json
import re

from pagedgen.guidance.spec import compile_guidance

_WHITESPACE = r"[ \t\r\n]"
MAX_GAP = 8  # whitespace characters allowed between the end tag and the answer


def constraint_after_text(kind: str, data: object, *, end: str, opener: str | None = None) -> str:
    """A Lark grammar: text up to the first ``end``, whitespace, then the constraint ``(kind, data)``.

    ``opener`` None: the output starts inside the free text (a prompt that opened it). Else the free part
    is optional and, when present, starts with whitespace and ``opener``; without it the output is the
    constraint alone. Raises :class:`pagedgen.errors.GuidanceError` if the constraint does not compile.
    """
    answer = _nested(compile_guidance(kind, data).grammar)
    free = f"pagedgen_free[lazy]: /(?s:.*){_lark_regex(end)}/"
    space = f"PAGEDGEN_SPACE: /{_WHITESPACE}{{1,{MAX_GAP}}}/"
    if opener is None:
        start = "start: pagedgen_free PAGEDGEN_SPACE? pagedgen_answer"
        rules = [start, free, space]
    else:
        start = "start: (PAGEDGEN_OPEN pagedgen_free PAGEDGEN_SPACE?)? pagedgen_answer"
        rules = [start, f"PAGEDGEN_OPEN: /{_WHITESPACE}*{_lark_regex(opener)}/", free, space]
    return "\n".join([*rules, f"pagedgen_answer: {answer}", ""])


def _nested(grammar: str) -> str:
    """llguidance's compiled grammar (Lark text, or its JSON of one grammar) as a Lark non-terminal."""
    stripped = grammar.lstrip()
    if not stripped.startswith("{"):
        return "%lark {\n" + grammar + "\n}"
    (entry,) = json.loads(stripped)["grammars"]
    if entry.get("json_schema") is not None:
        return "%json " + json.dumps(entry["json_schema"])
    return "%lark {\n" + entry["lark_grammar"] + "\n}"


def _lark_regex(text: str) -> str:
    """``text`` as a literal inside a Lark ``/.../`` regex."""
    return re.escape(text).replace("/", "\\/")
