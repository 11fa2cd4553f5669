"""A constraint that starts after free text: a reasoning model's ``<think> ... </think>``, then the answer.

A reasoning model writes its reasoning first and its answer after an end tag, and a client's constraint
(a JSON schema, a regex, a grammar, a forced tool call) is about the answer. Two ways to apply it only
after the reasoning: switch the constraint on when the end tag is seen, or constrain from the first token
with a grammar whose prefix is free text up to the end tag. The first is not exact here: the engine
samples the tokens of a step before any text is looked at, so the token after the end tag (and with
drafts several more) would be sampled unconstrained, and a token holding both the tag and the answer's
first characters could not be masked at all. The grammar is exact: llguidance masks every token, the tag
may be split across tokens or share one with the answer, and the answer is masked from its first byte.

:func:`constraint_after_text` builds that grammar in llguidance's Lark dialect: a *lazy* lexeme for the
free text (it ends at the first end tag, as the reply's parser reads it; a greedy one would let the text
run past a first end tag and the "answer" would start inside it), up to :data:`MAX_GAP` whitespace
characters (models write ``</think>\\n\\n``; unbounded, a model could spend its whole token budget on
whitespace there, which is why JSON's own whitespace is off too), then the constraint as llguidance itself
compiled it, nested as ``%json {...}`` or ``%lark {...}``, so JSON keeps its separators and a client's
grammar keeps its own rule names. The free text allows every token but EOS: a constrained turn cannot end
before its answer.
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
