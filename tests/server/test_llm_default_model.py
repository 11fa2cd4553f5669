"""``pg.LLM`` on the default model equals the engine's own public loop, token for token."""

from __future__ import annotations

import pytest

import pagedgen as pg

pytestmark = pytest.mark.model


def _engine_loop(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The engine loop, written out: one request per prompt, greedy, drained until every turn finishes."""
    engine = pg.Engine(model, pg.EngineConfig(num_blocks=64))
    requests, tokens = [], {}
    for prompt in prompts:
        request = engine.create_request(pg.GeneratorParams(model), pg.RequestOptions())
        options = pg.TurnOptions(request)
        options.set_max_generated_tokens(max_tokens)
        request.begin_turn(prompt, options)
        requests.append(request)
        tokens[id(request)] = []
    while engine.has_pending_requests():
        for event in engine.run(max_events=64):
            if event.flags & pg.EngineEventFlags.TOKEN:
                tokens[id(event.request)].append(event.token)
    engine.close()
    return [tokens[id(r)] for r in requests]


def test_generate_equals_the_engine_loop(default_model, reference_llm):
    texts = ["The capital of France is", "def fibonacci(n):"]
    prompts = [reference_llm.tokenizer.encode(t) for t in texts]
    outputs = reference_llm.generate(texts, pg.SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert [o.token_ids for o in outputs] == _engine_loop(default_model, prompts, 6)
    assert [o.text for o in outputs] == [reference_llm.tokenizer.decode(o.token_ids) for o in outputs]
    stats = reference_llm.engine.stats()
    assert stats.free_blocks == stats.total_blocks
