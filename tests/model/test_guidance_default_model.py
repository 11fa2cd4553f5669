"""Guidance on the default model (SmolLM2-135M-Instruct): its llguidance tokenizer view, and a JSON schema
output that parses and validates, greedy and sampled, batched with an unguided request.

The broad schema suite lives with the server's structured outputs; this proves the engine path on a real
vocabulary (byte-level BPE, EOS ids from the chat template).
"""

from __future__ import annotations

import json

import jsonschema
import pytest

import pagedgen as pg
from pagedgen.guidance.tokenizer import guidance_tokenizer

pytestmark = pytest.mark.model

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"enum": ["big", "small", "coastal"]}, "maxItems": 3},
    },
    "required": ["city", "population"],
    "additionalProperties": False,
}


def test_the_tokenizer_view_has_the_model_s_vocabulary_and_eos(default_model):
    view = guidance_tokenizer(default_model)
    tokenizer = pg.Tokenizer(default_model)
    assert view.vocab_size == default_model.vocab_size
    assert sorted(view.eos_tokens) == sorted(default_model.eos_token_ids)
    ids = tokenizer.encode('{"city": "Paris"}')
    assert view.decode_str(ids) == tokenizer.decode(ids)
    assert guidance_tokenizer(default_model) is view


def test_json_schema_outputs_parse_and_validate(default_model):
    tokenizer = pg.Tokenizer(default_model)
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": "Describe Paris as JSON."}])
    )
    engine = pg.Engine(default_model, pg.EngineConfig(max_batch_size=4, num_blocks=64, debug_invariants=True))
    requests = []
    for sample in (False, True):
        params = pg.GeneratorParams(default_model)
        params.set_search_options(do_sample=sample, temperature=1.0, seed=3)
        params.set_guidance("json_schema", SCHEMA)
        requests.append(engine.create_request(params))
    free = engine.create_request(pg.GeneratorParams(default_model))
    for request in [*requests, free]:
        options = pg.TurnOptions(request)
        options.set_max_generated_tokens(64)
        request.begin_turn(prompt, options)
    tokens: dict[pg.Request, list[int]] = {r: [] for r in [*requests, free]}
    finish = {}
    while engine.has_pending_requests():
        for event in engine.run(max_events=64):
            if event.flags & pg.EngineEventFlags.TOKEN:
                tokens[event.request].append(event.token)
            if event.flags & pg.EngineEventFlags.TURN_FINISHED:
                finish[event.request] = event.finish_reason
    for request in requests:
        assert finish[request] is pg.FinishReason.EOS
        value = json.loads(tokenizer.decode(tokens[request]))
        jsonschema.validate(value, SCHEMA)
    assert engine.stats().guided_rows_masked == sum(len(tokens[r]) for r in requests)
