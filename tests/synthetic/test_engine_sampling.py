"""The sampling seam through the engine: per-request seeded streams survive batching and rollback."""

from __future__ import annotations

import pagedgen as pg
from tests.helpers import VOCAB, drain, expected_greedy, make_engine, submit, tokens_of

SAMPLED = {"do_sample": True, "temperature": 1.5, "top_p": 0.95, "seed": 1234}


def test_seeded_stream_is_the_same_alone_and_in_any_batch():
    engine = make_engine()
    alone = submit(engine, [3, 1, 4], 12, **SAMPLED)
    reference = tokens_of(drain(engine))[alone]
    assert reference != expected_greedy([3, 1, 4], 12)  # it really sampled
    engine = make_engine(block_size=4, max_scheduled_tokens=6)
    others = [
        submit(engine, [9, 9, 9, 9, 9], 10),
        submit(engine, [2, 7], 10, do_sample=True, top_k=3, seed=5),
        submit(engine, [1], 10, do_sample=True, temperature=0.7, min_p=0.1, seed=6),
    ]
    events = list(engine.run(max_events=16)) + list(engine.run(max_events=16))
    batched = submit(engine, [3, 1, 4], 12, **SAMPLED)  # arrives late, joins a running batch
    got = tokens_of(events + drain(engine))
    assert got[batched] == reference
    assert got[others[0]] == expected_greedy([9, 9, 9, 9, 9], 10)


def test_unseeded_request_records_its_seed_and_replays_with_it():
    engine = make_engine()
    request = submit(engine, [5, 6, 7], 10, do_sample=True, temperature=2.0)
    first = tokens_of(drain(engine))[request]
    replay = submit(engine, [5, 6, 7], 10, do_sample=True, temperature=2.0, seed=request.seed)
    assert tokens_of(drain(engine))[replay] == first


def test_min_new_tokens_keeps_eos_away_and_logit_bias_accepts_a_mapping():
    prompt = [8, 8, 8]
    free_run = expected_greedy(prompt, 5)
    engine = make_engine(pg.SyntheticModel(vocab_size=VOCAB, eos_token_id=free_run[0]))
    request = submit(engine, prompt, 4, min_new_tokens=2)
    tokens = tokens_of(drain(engine))[request]
    assert len(tokens) >= 2 and free_run[0] not in tokens[:2]
    params = pg.GeneratorParams(engine.model)
    params.set_search_options(logit_bias={7: 100.0})
    assert params.sampling.logit_bias == ((7, 100.0),)
    biased = engine.create_request(params)
    options = pg.TurnOptions(biased)
    options.set_max_generated_tokens(3)
    biased.begin_turn(prompt, options)
    assert tokens_of(drain(engine))[biased] == [7, 7, 7]
