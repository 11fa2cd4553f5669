"""Request lifecycle on the synthetic model: every finish reason, cancellation, close, abandonment, limits."""

from __future__ import annotations

import gc

import pytest

import pagedgen as pg
from pagedgen.engine.faults import FaultInjector
from pagedgen.models.synthetic import SyntheticTokenizer
from tests.helpers import (
    VOCAB,
    drain,
    expected_greedy,
    finishes_of,
    make_engine,
    submit,
    tokens_of,
    turn_options,
)

F = pg.EngineEventFlags


def only_finish(events, request) -> pg.EngineEvent:
    (finish,) = finishes_of(events)[request]
    return finish


def test_max_generated_tokens_combines_the_last_token_with_the_terminal_event():
    engine = make_engine()
    request = submit(engine, [1, 2, 3], 4)
    events = drain(engine)
    assert [e.flags for e in events] == [F.TOKEN, F.TOKEN, F.TOKEN, F.TOKEN | F.TURN_FINISHED]
    last = events[-1]
    assert last.finish_reason is pg.FinishReason.MAX_GENERATED_TOKENS
    assert last.usage == pg.Usage(prompt_tokens=3, generated_tokens=4, cached_prompt_tokens=0)
    assert all(e.request is request and e.turn_id == 1 for e in events)
    assert request.status is pg.RequestStatus.TURN_COMPLETE
    assert request.finish_reason is pg.FinishReason.MAX_GENERATED_TOKENS


def test_eos_ends_the_turn_and_is_never_emitted_or_appended():
    prompt = [10, 20, 30]
    free_run = expected_greedy(prompt, 6)
    model = pg.SyntheticModel(vocab_size=VOCAB, eos_token_id=free_run[2])
    engine = make_engine(model)
    request = submit(engine, prompt, 50)
    events = drain(engine)
    assert [e.token for e in events] == [free_run[0], free_run[1], None]
    assert events[-1].flags == F.TURN_FINISHED
    assert events[-1].finish_reason is pg.FinishReason.EOS
    assert events[-1].usage == pg.Usage(prompt_tokens=3, generated_tokens=2)
    assert request.tokens == tuple(prompt + free_run[:2])
    assert request.processed_length == len(prompt) + 2  # the last generated token is in the cache


def test_ignore_eos_emits_the_eos_token_as_output():
    prompt = [10, 20, 30]
    free_run = expected_greedy(prompt, 5)
    engine = make_engine(pg.SyntheticModel(vocab_size=VOCAB, eos_token_id=free_run[2]))
    request = submit(engine, prompt, 5, ignore_eos=True)
    assert tokens_of(drain(engine))[request] == free_run


def test_max_session_tokens_counts_prompt_generated_and_continuation():
    engine = make_engine()
    request = submit(engine, list(range(1, 8)), 0, max_session_tokens=10)
    events = drain(engine)
    assert tokens_of(events)[request] == expected_greedy(range(1, 8), 3)
    finish = only_finish(events, request)
    assert finish.finish_reason is pg.FinishReason.MAX_SESSION_TOKENS
    assert request.sequence_length == 10
    with pytest.raises(pg.EngineError, match="max_session_tokens"):
        request.begin_turn([5])
    # max_length is the default and the cap of max_session_tokens.
    params = pg.GeneratorParams(engine.model)
    params.set_search_options(max_length=12)
    limited = engine.create_request(params)
    limited.begin_turn([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert tokens_of(drain(engine))[limited] == expected_greedy(range(1, 11), 2)
    options = pg.RequestOptions()
    options.set_max_session_tokens(13)
    with pytest.raises(pg.EngineError, match="exceeds max_length"):
        engine.create_request(params, options)


def test_per_turn_limit_resets_and_session_limit_spans_turns():
    engine = make_engine()
    request = submit(engine, [1, 2], 3, max_session_tokens=12)
    drain(engine)
    request.begin_turn([3, 4], turn_options(request, 0))  # no per-turn limit: runs into the session limit
    events = drain(engine)
    assert len(tokens_of(events)[request]) == 12 - 7
    assert only_finish(events, request).finish_reason is pg.FinishReason.MAX_SESSION_TOKENS


def test_stop_string_finishes_the_turn_and_is_not_emitted():
    prompt = [11, 12, 13]
    gen = expected_greedy(prompt, 12)
    text = SyntheticTokenizer(VOCAB).decode(gen)
    stop = text[4:6]
    start = text.find(stop)  # the first occurrence decides (it may start earlier than index 4)
    engine = make_engine()
    request = submit(engine, prompt, 12, stop_strings=["\x00never", stop])
    events = drain(engine)
    assert tokens_of(events)[request] == gen[:start]
    finish = only_finish(events, request)
    assert finish.finish_reason is pg.FinishReason.STOP_SEQUENCE is pg.FinishReason.STOP_STRING
    assert finish.matched_stop_string_index == 1
    assert finish.usage.generated_tokens == start + len(stop)
    assert request.tokens == tuple(prompt + gen[: start + len(stop)])


def test_logprobs_ride_on_token_events():
    engine = make_engine()
    request = submit(engine, [5, 6], 3, logprobs=2)
    events = drain(engine)
    assert [e.token for e in events] == expected_greedy([5, 6], 3)
    assert all(e.request is request for e in events)
    for event in events:
        assert event.logprobs is not None and event.logprobs.logprob <= 0
        assert len(event.logprobs.top) == 2 and event.logprobs.top[0][0] == event.token
    plain = submit(engine, [5, 6], 1)
    assert drain(engine)[0].logprobs is None and plain.status is pg.RequestStatus.TURN_COMPLETE


def test_cancel_a_queued_first_turn_then_a_later_turn_prefetches_both_inputs():
    engine = make_engine()
    request = submit(engine, [1, 2, 3], 5)
    assert request.cancel_turn(1) is True
    assert request.cancel_turn(1) is False  # already complete
    events = drain(engine)
    assert [(e.flags, e.finish_reason, e.usage) for e in events] == [
        (F.TURN_FINISHED, pg.FinishReason.CANCELLED, pg.Usage(3, 0))
    ]
    assert engine.stats().resident_requests == 0 and engine.stats().free_blocks == 256
    assert request.begin_turn([4, 5], turn_options(request, 4)) == 2
    events = drain(engine)
    assert tokens_of(events)[request] == expected_greedy([1, 2, 3, 4, 5], 4)
    assert only_finish(events, request).usage == pg.Usage(2, 4)


def test_cancel_an_active_turn_keeps_committed_state_and_continues_later():
    engine = make_engine()
    request = submit(engine, [1, 2, 3], 50)
    buffer = engine.create_event_buffer(8)
    first = [e.token for _ in range(3) for e in engine.run(buffer)]
    assert first == expected_greedy([1, 2, 3], 3)
    assert request.cancel_turn(7) is False and request.cancel_turn(0) is False
    assert request.cancel_turn(1) is True
    events = drain(engine)
    assert [(e.flags, e.finish_reason, e.usage) for e in events] == [
        (F.TURN_FINISHED, pg.FinishReason.CANCELLED, pg.Usage(3, 3))
    ]
    assert request.tokens == tuple([1, 2, 3] + first) and request.processed_length == 5
    request.begin_turn([9], turn_options(request, 2))
    assert tokens_of(drain(engine))[request] == expected_greedy([1, 2, 3, *first, 9], 2)


def test_turn_ids_are_monotonic_from_one():
    engine = make_engine()
    request = submit(engine, [1], 1)
    ids = [1]
    for _ in range(3):
        drain(engine)
        ids.append(request.begin_turn([2], turn_options(request, 1)))
    assert ids == [1, 2, 3, 4] and request.turn_id == 4


def test_close_purges_undrained_events_and_frees_blocks_immediately():
    engine = make_engine(block_size=4)
    keep = submit(engine, [1, 2], 3)
    request = submit(engine, list(range(1, 10)), 3)  # 9 tokens: 3 blocks of 4
    first = engine.run(max_events=1)
    assert first[0].request is keep and engine.stats().pending_events == 1
    free = engine.stats().free_blocks
    request.close()
    assert request.status is pg.RequestStatus.CLOSED
    assert engine.stats().pending_events == 0 and engine.stats().free_blocks == free + 3
    request.close()  # idempotent
    with pytest.raises(pg.EngineError, match="closed"):
        request.cancel_turn(1)
    assert tokens_of(drain(engine))[keep] == expected_greedy([1, 2], 3)[1:]
    assert engine.check_invariants() == []


def test_dropped_request_is_reclaimed_at_the_next_boundary():
    engine = make_engine(block_size=4)
    request = submit(engine, list(range(1, 10)), 3)
    engine.run(max_events=8)
    assert engine.stats().free_blocks == 256 - 3
    del request
    gc.collect()
    assert engine.stats().resident_requests == 1  # nothing happens until an engine boundary
    assert engine.has_pending_requests() is False
    assert engine.stats().free_blocks == 256 and engine.stats().resident_requests == 0
    assert engine.check_invariants() == []


def test_retained_events_keep_their_request_alive_until_drained():
    engine = make_engine()
    buffer = engine.create_event_buffer(1)
    a = submit(engine, [1, 2], 5)
    b = submit(engine, [3, 4], 5)
    assert engine.run(buffer)[0].request is a
    b_id = b.id
    del b
    gc.collect()
    event = engine.run(buffer)[0]  # the retained event still names the caller's (now unreferenced) handle
    assert event.request.id == b_id and event.token == expected_greedy([3, 4], 1)[0]
    assert engine.stats().resident_requests == 2
    del event
    engine.run(buffer)  # resets the buffer: the handle dies and the next boundary reclaims the request
    assert engine.has_pending_requests() and engine.stats().resident_requests == 1
    assert b_id not in engine.snapshot()["requests"] and a.status is pg.RequestStatus.ACTIVE
    assert engine.check_invariants() == []


def test_engine_close_releases_everything_and_refuses_work():
    engine = make_engine()
    requests = [submit(engine, [i + 1, 2, 3], 5) for i in range(3)]
    engine.run(max_events=2)
    engine.close()
    assert engine.stats().free_blocks == 256 and engine.stats().resident_requests == 0
    for request in requests:
        assert request.status is pg.RequestStatus.CLOSED
        request.close()
        with pytest.raises(pg.EngineError, match="closed"):
            request.begin_turn([1])
    with pytest.raises(pg.EngineError, match="closed"):
        engine.run(max_events=1)
    with pytest.raises(pg.EngineError, match="closed"):
        engine.create_request(pg.GeneratorParams(engine.model))
    engine.close()  # idempotent


def test_capacity_zero_is_a_no_op():
    faults = FaultInjector()
    engine = make_engine(faults=faults)
    submit_kept = submit(engine, [1, 2], 2)
    assert len(engine.run(max_events=0)) == 0
    assert faults.hits[next(p for p in faults.hits if p.value == "plan")] == 0
    assert submit_kept.status is pg.RequestStatus.ASSIGNED


def test_stats_and_capabilities():
    engine = make_engine(block_size=4, num_blocks=32)
    assert engine.max_draft_tokens_per_proposal() == pg.EngineConfig().max_draft_tokens == 8
    waiting = submit(engine, list(range(1, 10)), 2)
    waiting.set_draft_tokens([])
    with pytest.raises(pg.EngineError, match="draft"):  # queued: drafts wait for a decode
        waiting.set_draft_tokens([1, 2])
    stats = engine.stats()
    assert (stats.total_blocks, stats.free_blocks, stats.resident_requests, stats.queued_requests) == (
        32,
        32,
        0,
        1,
    )
    engine.run(max_events=1)
    stats = engine.stats()
    assert (stats.free_blocks, stats.resident_requests, stats.queued_requests, stats.steps) == (29, 1, 0, 1)
    assert stats.pending_events == 0 and stats.rollbacks == 0 and stats.healthy
    assert (stats.drafts_proposed, stats.drafts_accepted, stats.draft_acceptance_rate) == (0, 0, 0.0)


def test_unserviceable_turn_fails_while_others_go_on():
    engine = make_engine(block_size=4, num_blocks=4)
    big = submit(engine, list(range(1, 21)), 2)  # 20 tokens need 5 blocks of 4: more than the pool
    small = submit(engine, [1, 2], 3)
    events = drain(engine)
    finish = only_finish(events, big)
    assert finish.flags == F.TURN_FINISHED | F.FAILED
    assert finish.finish_reason is pg.FinishReason.FAILED
    assert finish.error_code is pg.EngineErrorCode.REQUEST_UNSERVICEABLE
    assert finish.usage == pg.Usage(20, 0)
    assert tokens_of(events)[small] == expected_greedy([1, 2], 3)
    assert big.status is pg.RequestStatus.TURN_COMPLETE and engine.stats().healthy
    # Alone, an unserviceable turn is the whole step's outcome.
    big.begin_turn([1], turn_options(big, 1))
    events = drain(engine)
    assert only_finish(events, big).error_code is pg.EngineErrorCode.REQUEST_UNSERVICEABLE


def test_num_blocks_rule():
    model = pg.SyntheticModel(vocab_size=VOCAB, max_context=64)
    per_block = model.kv_spec.bytes_per_block(16)
    engine = pg.Engine(model, pg.EngineConfig(kv_cache_memory_bytes=10 * per_block + 5))
    assert engine.stats().total_blocks == 10
    engine = pg.Engine(model, pg.EngineConfig(max_batch_size=3))
    assert engine.stats().total_blocks == 3 * 4  # capped at max_batch_size requests of max_context tokens
    with pytest.raises(ValueError, match="holds no block"):
        pg.Engine(model, pg.EngineConfig(kv_cache_memory_bytes=per_block - 1))
