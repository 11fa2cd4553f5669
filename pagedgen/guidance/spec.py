"""What a request asks its output to match, compiled to an llguidance grammar when it is set.

:func:`compile_guidance` validates a spec without a tokenizer, so a schema or grammar that does not compile
is refused (:class:`GuidanceError`, llguidance's own message) at the call that sets it, not in a step. The
kinds, the JSON whitespace defaults and the parser limits: docs/engine.md, "Guidance specs".
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import llguidance

from pagedgen.errors import GuidanceError
from pagedgen.guidance.lru import BoundedLru

GUIDANCE_KINDS = ("json_schema", "regex", "lark_grammar")
JSON_DEFAULTS: dict[str, bool | str] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
MAX_GUIDANCE_CHARS = 1 << 20  # a grammar or schema larger than 1 MiB of text is refused
COMPILED_SPECS = 128  # compiled specs kept (a service reuses a few schemas a lot)
COMPILED_SPECS_BYTES = 64 << 20  # ... and at most this many characters of constraint and grammar text

# llguidance's parser limits; its defaults where they already bound a step, tighter where they did not.
MAX_ITEMS_IN_ROW = 2_000  # Earley items of one grammar row (the branching of one position): the default
INITIAL_LEXER_FUEL = 200_000  # building the lexer's initial regexes (default 1M: "(a{1000}){999}" took 3.5 s)
STEP_LEXER_FUEL = 200_000  # lexer work of one token mask (the default; ~14k per ms)
STEP_MAX_ITEMS = 50_000  # Earley items of one token mask (the default; ~20k per ms)
MAX_LEXER_STATES = 100_000  # lexer states one matcher may build, 1-2 kB each (default 250k)
MAX_GRAMMAR_SIZE = 500_000  # symbols in the grammar's productions (the default)


def parser_limits() -> llguidance.LLParserLimits:
    """The limits every grammar is validated and matched under (errors without llguidance's state dump:
    the message goes to the client)."""
    return llguidance.LLParserLimits(
        max_items_in_row=MAX_ITEMS_IN_ROW,
        initial_lexer_fuel=INITIAL_LEXER_FUEL,
        step_lexer_fuel=STEP_LEXER_FUEL,
        step_max_items=STEP_MAX_ITEMS,
        max_lexer_states=MAX_LEXER_STATES,
        max_grammar_size=MAX_GRAMMAR_SIZE,
        verbose_errors=False,
    )


@dataclass(frozen=True, slots=True)
class GuidanceSpec:
    """One compiled constraint: ``kind`` and ``data`` as given, ``grammar`` as llguidance reads it."""

    kind: str
    data: str
    grammar: str

    def __repr__(self) -> str:
        shown = self.data if len(self.data) <= 60 else self.data[:60] + "..."
        return f"GuidanceSpec({self.kind!r}, {shown!r})"


def compile_guidance(kind: object, data: object) -> GuidanceSpec:
    """Check ``kind`` and ``data`` and compile them; raises :class:`GuidanceError` naming the problem."""
    if kind not in GUIDANCE_KINDS:
        raise GuidanceError(f"guidance kind must be one of {', '.join(GUIDANCE_KINDS)}; got {kind!r}")
    text = _data_text(kind, data)
    if len(text) > MAX_GUIDANCE_CHARS:
        raise GuidanceError(f"{kind} is {len(text)} characters; at most {MAX_GUIDANCE_CHARS} are accepted")
    return _compiled(kind, text)


_specs: BoundedLru[GuidanceSpec] = BoundedLru(COMPILED_SPECS, COMPILED_SPECS_BYTES)


def _compiled(kind: str, text: str) -> GuidanceSpec:
    """The spec of ``(kind, text)``, memoised: one request's constraint is set on its params, its turn and
    (on the server) checked before admission, and a service reuses a few schemas; specs are immutable, and
    a refusal raises, so it is never cached. An entry is charged the characters it holds."""
    spec = _specs.get((kind, text))
    if spec is not None:
        return spec
    grammar = _grammar(kind, text)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, limits=parser_limits())
    if is_error:
        raise GuidanceError(f"{kind} does not compile: {messages[0].strip()}")
    spec = GuidanceSpec(kind, text, grammar)
    _specs.put((kind, text), spec, len(text) + len(grammar))
    return spec


def _data_text(kind: str, data: object) -> str:
    if kind == "json_schema" and isinstance(data, Mapping | bool):
        try:
            return json.dumps(data)
        except (TypeError, ValueError) as exc:
            raise GuidanceError(f"json_schema is not JSON-serialisable: {exc}") from exc
    if not isinstance(data, str):
        raise GuidanceError(f"{kind} must be given as a str, got {type(data).__name__}")
    if not data:
        raise GuidanceError(f"{kind} is empty")
    return data


def _grammar(kind: str, text: str) -> str:
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except ValueError as exc:
            raise GuidanceError(f"json_schema is not valid JSON: {exc}") from exc
        if not isinstance(schema, dict | bool):
            raise GuidanceError(f"json_schema must be a JSON object or boolean, got {type(schema).__name__}")
        try:
            defaults = None if isinstance(schema, dict) and "x-guidance" in schema else JSON_DEFAULTS
            return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=defaults)
        except ValueError as exc:
            raise GuidanceError(f"json_schema does not compile: {exc}") from exc
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    return llguidance.LLMatcher.grammar_from_lark(text)
