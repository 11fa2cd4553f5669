"""Guidance specs (pagedgen/guidance/spec.py): what compiles, what is refused and why, the JSON format."""

from __future__ import annotations

import json

import pytest

from pagedgen.errors import GuidanceError
from pagedgen.guidance import compile_guidance
from pagedgen.guidance.spec import MAX_GUIDANCE_CHARS
from tests.helpers import guidance_accepts

accepts = guidance_accepts  # does the constraint accept the whole text?


SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "array"}},
    "required": ["a", "b"],
}


def test_json_is_written_as_json_dumps_writes_it_with_no_free_whitespace():
    value = {"a": 3, "b": [1, "x"]}
    assert accepts("json_schema", SCHEMA, json.dumps(value))
    assert not accepts("json_schema", SCHEMA, json.dumps(value, separators=(",", ":")))
    assert not accepts("json_schema", SCHEMA, json.dumps(value, indent=2))
    assert not accepts("json_schema", SCHEMA, " " + json.dumps(value))


def test_a_schema_s_own_x_guidance_options_override_the_format():
    schema = {**SCHEMA, "x-guidance": {"whitespace_flexible": True}}
    assert accepts("json_schema", schema, json.dumps({"a": 3, "b": []}, indent=2))


def test_a_schema_given_as_text_or_dict_compiles_the_same():
    assert (
        compile_guidance("json_schema", SCHEMA).grammar
        == compile_guidance("json_schema", json.dumps(SCHEMA)).grammar
    )


@pytest.mark.parametrize(
    ("kind", "data", "message"),
    [
        ("yaml", "a: 1", "guidance kind must be one of json_schema, regex, lark_grammar; got 'yaml'"),
        (None, "x", "got None"),
        ("json_schema", "{not json", "json_schema is not valid JSON"),
        ("json_schema", "[1, 2]", "must be a JSON object or boolean, got list"),
        ("json_schema", {"type": 5}, "json_schema does not compile: type must be a string"),
        ("json_schema", {"$ref": "#/$defs/missing"}, "does not compile"),
        ("json_schema", {"x": {1, 2}}, "not JSON-serialisable"),
        ("regex", "a(", "regex does not compile"),
        ("regex", b"abc", "regex must be given as a str, got bytes"),
        ("regex", "", "regex is empty"),
        ("lark_grammar", "start: missing_rule", "lark_grammar does not compile"),
        ("lark_grammar", "x" * (MAX_GUIDANCE_CHARS + 1), "at most"),
    ],
)
def test_what_does_not_compile_is_refused_naming_the_problem(kind, data, message):
    with pytest.raises(GuidanceError, match=message.replace("(", r"\(").replace("[", r"\[")):
        compile_guidance(kind, data)


def test_regex_and_lark_match_their_whole_language():
    assert accepts("regex", r"\d{3}-[a-z]+", "123-abc")
    assert not accepts("regex", r"\d{3}-[a-z]+", "123-abc!")
    grammar = 'start: "(" item ("," item)* ")"\nitem: /[a-z]+/'
    assert accepts("lark_grammar", grammar, "(ab,c)") and not accepts("lark_grammar", grammar, "(ab,)")


def test_the_same_constraint_compiles_once_and_a_refusal_is_never_cached():
    first = compile_guidance("json_schema", SCHEMA)
    assert compile_guidance("json_schema", json.dumps(SCHEMA)) is first  # the same text: the same spec
    assert compile_guidance("regex", "[0-9]+") is not compile_guidance("regex", "[0-9]*")
    for _ in range(2):
        with pytest.raises(GuidanceError, match="regex does not compile"):
            compile_guidance("regex", "a(")
