"""``pg.StructuredOutputsParams``: exactly one constraint, compiled when built, and the grammar it becomes.

A byte-level llguidance matcher (one token per byte) checks what a compiled constraint accepts, so the
choice grammar is proven exact (special characters match literally) without a model.
"""

from __future__ import annotations

import json

import pytest

import pagedgen as pg
from pagedgen.errors import SamplingOptionsError
from pagedgen.guidance import compile_guidance
from pagedgen.llm import choice_grammar, generator_params, turn_options
from pagedgen.models.synthetic import SyntheticModel
from tests.helpers import guidance_accepts

accepts = guidance_accepts  # does the constraint accept the whole text?


SPECIAL = ['say "hi"', "back\\slash", "two\nlines\ttab", "é 😀 中文", "a|b", "/x+/", "${x}", "\x00\x7f", ""]


def test_choice_matches_exactly_each_choice_with_special_characters():
    params = pg.StructuredOutputsParams(choice=SPECIAL)
    kind, grammar = params.guidance()
    assert kind == "lark_grammar" and grammar == choice_grammar(SPECIAL)
    for choice in SPECIAL:
        assert accepts(kind, grammar, choice), choice
    for other in ['say "hi', 'say "hi""', "back\\\\slash", "a", "b", "x", "/xx/", "é", "two\\nlines\\ttab"]:
        assert not accepts(kind, grammar, other), other


def test_choice_of_one_accepts_nothing_else():
    kind, grammar = pg.StructuredOutputsParams(choice=["yes"]).guidance()
    assert accepts(kind, grammar, "yes")
    assert (
        not accepts(kind, grammar, "ye")
        and not accepts(kind, grammar, "yess")
        and not accepts(kind, grammar, "")
    )


@pytest.mark.parametrize(
    ("kwargs", "kind", "accepted", "refused"),
    [
        ({"json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}},
         "json_schema", '{"a": 3}', '{"a": "3"}'),
        ({"json": '{"type": "array", "items": {"type": "boolean"}, "maxItems": 2}'},
         "json_schema", "[true, false]", "[true, false, true]"),
        ({"json_object": True}, "json_schema", '{"x": [1, {"y": null}]}', "[1]"),
        ({"regex": r"[0-9]{3}-[a-z]+"}, "regex", "123-abc", "12-abc"),
        ({"grammar": 'start: "(" item ("," item)* ")"\nitem: /[a-z]+/'}, "lark_grammar", "(ab,c)", "(ab,)"),
    ],
    ids=["json-dict", "json-text", "json_object", "regex", "grammar"],
)  # fmt: skip
def test_each_constraint_compiles_to_what_it_accepts(kwargs, kind, accepted, refused):
    params = pg.StructuredOutputsParams(**kwargs)
    assert params.kind == next(iter(kwargs))
    got_kind, data = params.guidance()
    assert got_kind == kind
    assert accepts(kind, data, accepted)
    assert not accepts(kind, data, refused)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({}, "structured_outputs"),
        ({"json_object": False}, "structured_outputs"),
        ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
        ({"json": {"type": "object"}, "json_object": True}, "structured_outputs"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"json": {"type": "nonsense"}}, "structured_outputs.json"),
        ({"json": 5}, "structured_outputs.json"),
        ({"json": {"$ref": "#/$defs/missing"}}, "structured_outputs.json"),
        ({"regex": "(unclosed"}, "structured_outputs.regex"),
        ({"regex": 5}, "structured_outputs.regex"),
        ({"regex": ""}, "structured_outputs.regex"),
        ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar"),
        ({"grammar": "not a grammar"}, "structured_outputs.grammar"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"choice": "ab"}, "structured_outputs.choice"),
        ({"choice": ["a", 1]}, "structured_outputs.choice"),
        ({"json_object": "yes"}, "structured_outputs.json_object"),
    ],
)
def test_a_bad_constraint_is_refused_naming_its_field(kwargs, field):
    with pytest.raises(SamplingOptionsError) as info:
        pg.StructuredOutputsParams(**kwargs)
    assert info.value.field == field
    assert field.split(".")[-1] in str(info.value)


def test_sampling_params_takes_only_structured_outputs_params():
    with pytest.raises(SamplingOptionsError) as info:
        pg.SamplingParams(structured_outputs={"regex": "a"})
    assert info.value.field == "structured_outputs"


def test_the_constraint_is_set_on_the_params_and_on_every_turn():
    """On the turn, so ``ChatSession.send`` can constrain one turn; on the params too, where it is checked
    against the model's tokenizer before ``LLM.generate`` submits anything."""
    model = SyntheticModel(vocab_size=95)
    engine = pg.Engine(model, pg.EngineConfig(max_batch_size=2, num_blocks=8))
    try:
        params = pg.SamplingParams(structured_outputs=pg.StructuredOutputsParams(regex="[a-z]+"))
        request_params = generator_params(model, params)
        assert request_params.guidance.kind == "regex" and request_params.guidance.data == "[a-z]+"
        request = engine.create_request(request_params, pg.RequestOptions())
        spec = turn_options(request, params).spec
        assert spec.guidance_set and spec.guidance.kind == "regex" and spec.guidance.data == "[a-z]+"
        assert generator_params(model, pg.SamplingParams()).guidance is None
        assert not turn_options(request, pg.SamplingParams()).spec.guidance_set
        request.close()
    finally:
        engine.close()


def test_a_json_dict_and_its_text_compile_to_the_same_grammar():
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}}
    from_dict = compile_guidance(*pg.StructuredOutputsParams(json=schema).guidance())
    from_text = compile_guidance(*pg.StructuredOutputsParams(json=json.dumps(schema)).guidance())
    assert from_dict.grammar == from_text.grammar


def test_generate_refuses_a_constraint_the_tokenizer_cannot_follow_before_submitting_anything():
    """``<[500]>`` (token 500) compiles as a grammar but not for a 95-token vocabulary."""
    llm = pg.LLM(SyntheticModel(vocab_size=95), pg.EngineConfig(max_batch_size=4, num_blocks=16))
    bad = pg.StructuredOutputsParams(grammar="start: <[500]>")
    with pytest.raises(ValueError, match="tokenizer") as info:
        llm.generate([[1, 2], [3, 4]], [pg.SamplingParams(), pg.SamplingParams(structured_outputs=bad)])
    assert info.value.field == "guidance"
    stats = llm.engine.stats()
    assert (
        stats.steps == 0 and not llm.engine.has_pending_requests() and stats.free_blocks == stats.total_blocks
    )
