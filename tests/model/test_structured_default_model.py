"""Structured outputs on the default model (SmolLM2-135M) through ``pg.LLM``: every output is valid.

One ``generate`` batch holds, for each JSON schema, a greedy and two seeded sampled prompts, plus regex,
Lark and choice prompts, plus unconstrained prompts; the unconstrained ones must equal their outputs
generated alone (the constraint of a neighbour changes nothing else). Every schema is bounded so that any
output it allows completes well within ``MAX_TOKENS``: every object has ``additionalProperties: false``,
strings have a ``maxLength`` or a fixed ``pattern``, arrays a ``maxItems``, numbers bounds and a
``multipleOf`` (llguidance allows any number of decimals otherwise), and a token is at least one byte.
Outputs must then finish with ``stop`` (the grammar ended, EOS) and parse and validate with ``jsonschema``.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

import pagedgen as pg

pytestmark = pytest.mark.model

MAX_TOKENS = 320
NAME = {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"}
SCHEMAS: dict[str, dict] = {
    "nested_object": {
        "type": "object",
        "properties": {
            "name": NAME,
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "nickname": {"type": "string", "maxLength": 10},  # optional
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 16},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "address"],
        "additionalProperties": False,
    },
    "array_of_enums": {
        "type": "array",
        "items": {"enum": ["red", "green", "blue", "yellow"]},
        "minItems": 1,
        "maxItems": 5,
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "temperature": {"type": "number", "minimum": -40, "maximum": 50, "multipleOf": 0.5},
            "probability": {
                "type": "number",
                "exclusiveMinimum": 0,
                "exclusiveMaximum": 1,
                "multipleOf": 0.01,
            },
            "count": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
            "offset": {"type": "integer", "minimum": -1000, "maximum": 1000},
            "valid": {"type": "boolean"},
        },
        "required": ["temperature", "probability", "count", "offset", "valid"],
        "additionalProperties": False,
    },
    "defs_refs_nullable": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -99, "maximum": 99},
                    "y": {"type": "integer", "minimum": -99, "maximum": 99},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "label": {"anyOf": [{"type": "string", "maxLength": 12}, {"type": "null"}]},
        },
        "type": "object",
        "properties": {
            "start": {"$ref": "#/$defs/point"},
            "end": {"anyOf": [{"$ref": "#/$defs/point"}, {"type": "null"}]},
            "label": {"$ref": "#/$defs/label"},
        },
        "required": ["start", "end", "label"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "item": NAME,
                "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                "in_stock": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
            },
            "required": ["item", "quantity", "in_stock"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
    "enum_and_const": {
        "type": "object",
        "properties": {
            "kind": {"const": "event"},
            "level": {"enum": ["low", "medium", "high", 1, None]},
            "day": {"type": "string", "enum": ["Mon", "Tue", "Wed"]},
        },
        "required": ["kind", "level"],
        "additionalProperties": False,
    },
}
REGEX = r"[A-Z][a-z]{2,8} [0-9]{1,2}, (19|20)[0-9]{2}"
LARK = 'start: expr\nexpr: NUM (OP NUM){0,3}\nNUM: /[1-9][0-9]{0,2}/\nOP: " + " | " - " | " * "'
LARK_AS_REGEX = r"[1-9][0-9]{0,2}(?: [-+*] [1-9][0-9]{0,2}){0,3}"  # the same language, checked by Python
CHOICES = ["positive", "negative", "neutral", 'it is "mixed"']
FREE_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
FREE = pg.SamplingParams(max_tokens=24, temperature=0)
SEEDS = (7, 1234)


def _chat(llm: pg.LLM, text: str) -> str:
    return llm.render_chat([{"role": "user", "content": text}])


def _sampling(structured: pg.StructuredOutputsParams, seed: int | None) -> pg.SamplingParams:
    if seed is None:
        return pg.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, structured_outputs=structured)
    return pg.SamplingParams(
        max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.95, seed=seed, structured_outputs=structured
    )


@pytest.fixture(scope="module")
def llm(default_model):
    return pg.LLM(default_model, pg.EngineConfig(max_batch_size=32, num_blocks=512, debug_invariants=True))


@pytest.fixture(scope="module")
def batch(llm):
    """One generate call: every constrained case greedy and sampled, mixed with unconstrained prompts."""
    cases: list[tuple[str, str, pg.SamplingParams]] = []  # (case name, prompt, params)
    for name, schema in SCHEMAS.items():
        prompt = _chat(llm, f"Reply with JSON only. Schema: {json.dumps(schema)}")
        structured = pg.StructuredOutputsParams(json=schema)
        for seed in (None, *SEEDS):
            cases.append((f"json:{name}", prompt, _sampling(structured, seed)))
    others = {
        "regex": ("Write a date like 'March 14, 2015'.", pg.StructuredOutputsParams(regex=REGEX)),
        "lark": ("Write a short sum of numbers.", pg.StructuredOutputsParams(grammar=LARK)),
        "choice": ("Is 'I love it' positive or negative?", pg.StructuredOutputsParams(choice=CHOICES)),
        "json_object": (
            "Describe a cat as a JSON object with its name and age.",
            pg.StructuredOutputsParams(json_object=True),
        ),
    }
    for name, (question, structured) in others.items():
        for seed in (None, *SEEDS):
            if name == "json_object" and seed is not None:
                continue  # an open object can grow without bound when sampled: greedy only
            cases.append((name, _chat(llm, question), _sampling(structured, seed)))
    for index, prompt in enumerate(FREE_PROMPTS):  # interleaved with the constrained ones
        cases.insert(4 * index + 1, ("free", prompt, FREE))
    outputs = llm.generate([p for _, p, _ in cases], [s for _, _, s in cases], use_tqdm=False)
    return cases, outputs


def _check(name: str, text: str) -> None:
    if name.startswith("json:"):
        jsonschema.validate(json.loads(text), SCHEMAS[name.removeprefix("json:")])
    elif name == "json_object":
        assert isinstance(json.loads(text), dict)
    elif name == "regex":
        assert re.fullmatch(REGEX, text), text
    elif name == "lark":
        assert re.fullmatch(LARK_AS_REGEX, text), text
    elif name == "choice":
        assert text in CHOICES


def test_every_constrained_output_of_a_mixed_batch_is_valid(batch):
    cases, outputs = batch
    checked = 0
    for (name, _prompt, params), output in zip(cases, outputs, strict=True):
        if name == "free":
            continue
        label = f"{name} seed={params.seed}: {output.text!r}"
        assert output.finish_reason == "stop", label
        assert len(output.token_ids) < MAX_TOKENS, label
        _check(name, output.text)
        checked += 1
    assert checked == 3 * len(SCHEMAS) + 3 * 3 + 1


def test_sampled_outputs_are_reproducible_and_differ_from_greedy_somewhere(llm, batch):
    cases, outputs = batch
    by_case: dict[str, list[str]] = {}
    for (name, _prompt, _params), output in zip(cases, outputs, strict=True):
        by_case.setdefault(name, []).append(output.text)
    assert any(len(set(texts)) > 1 for name, texts in by_case.items() if name != "free")
    index = next(i for i, c in enumerate(cases) if c[0] == "json:nested_object" and c[2].seed == SEEDS[0])
    _name, prompt, params = cases[index]
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert again.text == outputs[index].text


def test_unconstrained_neighbours_equal_their_outputs_alone(llm, batch):
    cases, outputs = batch
    free = [
        (prompt, output) for (name, prompt, _), output in zip(cases, outputs, strict=True) if name == "free"
    ]
    assert [prompt for prompt, _ in free] == FREE_PROMPTS
    for prompt, output in free:
        alone = llm.generate([prompt], FREE, use_tqdm=False)[0]
        assert output.token_ids == alone.token_ids
        assert output.text == alone.text


def test_llm_chat_takes_structured_outputs(llm):
    conversations = [[{"role": "user", "content": f"Rate {thing} from 1 to 5."}] for thing in ("tea", "rain")]
    params = pg.SamplingParams(
        max_tokens=8, temperature=0, structured_outputs=pg.StructuredOutputsParams(regex="[1-5]")
    )
    outputs = llm.chat(conversations, params, use_tqdm=False)
    assert [o.finish_reason for o in outputs] == ["stop", "stop"]
    assert all(re.fullmatch("[1-5]", o.text) for o in outputs)


def test_chat_session_constrains_one_turn_only(llm):
    session = llm.start_chat(pg.SamplingParams(max_tokens=40, temperature=0))
    try:
        answer = "".join(
            session.send(
                "Pick a colour.", structured_outputs=pg.StructuredOutputsParams(choice=["red", "green"])
            )
        )
        assert answer in ("red", "green") and session.last.finish_reason == "stop"
        free = "".join(session.send("Why?"))
        assert free == session.last.text and free not in ("red", "green")
    finally:
        session.close()
