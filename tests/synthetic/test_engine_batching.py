"""Continuous batching on the synthetic model: exact tokens in every batch composition and step shape."""

from __future__ import annotations

import torch

import pagedgen as pg
from pagedgen.engine.config import DEFAULT_CPU_MIXED_STEP_TOKENS, resolve_mixed_step_tokens
from pagedgen.engine.faults import FaultInjector
from tests.helpers import (
    VOCAB,
    drain,
    event_key,
    expected_greedy,
    finishes_of,
    make_engine,
    record_steps,
    submit,
    tokens_of,
    turn_options,
)

PROMPTS = [
    [(7 * i + 3 * j + 1) % VOCAB for j in range(n)] for i, n in enumerate([3, 17, 1, 40, 9, 25, 2, 33])
]
MAX_NEW = [12, 20, 7, 16, 30, 5, 18, 11]


def test_isolated_equals_batched_with_staggered_arrival():
    isolated = {}
    for i, prompt in enumerate(PROMPTS):
        engine = make_engine()
        request = submit(engine, prompt, MAX_NEW[i])
        isolated[i] = tokens_of(drain(engine))[request]
        assert isolated[i] == expected_greedy(prompt, MAX_NEW[i])

    # Small blocks, a tight token budget and arrivals every other call: chunked, mixed, ragged steps.
    steps: list = []
    engine = make_engine(
        block_size=4,
        max_scheduled_tokens=24,
        max_batch_size=8,
        num_blocks=96,
        wrap_runner=record_steps(steps),
    )
    buffer = engine.create_event_buffer(4)
    requests: dict[int, pg.Request] = {}
    events: list[pg.EngineEvent] = []
    call = 0
    while len(requests) < len(PROMPTS) or engine.has_pending_requests():
        if call % 2 == 0 and len(requests) < len(PROMPTS):
            i = len(requests)
            requests[i] = submit(engine, PROMPTS[i], MAX_NEW[i])
        events.extend(engine.run(buffer))
        call += 1
    got = tokens_of(events)
    for i, request in requests.items():
        assert got[request] == isolated[i], f"request {i}"
    assert any(len(q) > 1 and max(q) > 1 and min(q) == 1 for q, _ in steps), "no mixed prefill+decode step"
    assert all(sum(q) <= 24 for q, _ in steps)
    assert engine.stats().free_blocks == 96 - sum(engine.parts.cache.stats().blocks_per_request.values())
    for request in requests.values():
        request.close()
    assert engine.stats().free_blocks == 96
    assert engine.check_invariants() == []


def test_chunked_prefill_spans_several_steps_with_zero_event_runs():
    steps: list = []
    engine = make_engine(chunk_size=4, wrap_runner=record_steps(steps))
    prompt = list(range(1, 11))
    request = submit(engine, prompt, 3)
    buffer = engine.create_event_buffer(8)
    assert len(engine.run(buffer)) == 0 and engine.has_pending_requests()
    assert request.processed_length == 4 and request.status is pg.RequestStatus.ACTIVE
    assert len(engine.run(buffer)) == 0 and request.processed_length == 8
    events = list(engine.run(buffer))
    assert [e.token for e in events] == expected_greedy(prompt, 1)
    assert request.processed_length == 10
    events += drain(engine)
    assert tokens_of(events)[request] == expected_greedy(prompt, 3)
    assert steps == [([4], [0]), ([4], [4]), ([2], [8]), ([1], [10]), ([1], [11])]


def test_token_budget_alone_chunks_a_prompt():
    steps: list = []
    engine = make_engine(max_scheduled_tokens=4, wrap_runner=record_steps(steps))
    prompt = list(range(5, 15))
    request = submit(engine, prompt, 2)
    assert tokens_of(drain(engine))[request] == expected_greedy(prompt, 2)
    assert [q for q, _ in steps] == [[4], [4], [2], [1]]


def test_mixed_step_decodes_first_then_expands_prefills_in_order():
    steps: list = []
    engine = make_engine(max_scheduled_tokens=8, wrap_runner=record_steps(steps))
    a = submit(engine, [1, 2, 3], 6)
    engine.run(max_events=8)  # A prefilled; it now decodes
    b = submit(engine, list(range(20, 32)), 2)  # 12-token prompt
    c = submit(engine, [9, 9], 2)
    events = drain(engine)
    # Step 2: A's decode first; every row gets one token, then B (first prefill) takes the 5 spare tokens.
    assert steps[1] == ([1, 6, 1], [3, 0, 0])
    # Step 3: A decodes, B sends its last 6 tokens, C its last one.
    assert steps[2] == ([1, 6, 1], [4, 6, 1])
    assert steps[3] == ([1, 1, 1], [5, 12, 2])  # a pure decode step
    got = tokens_of(events)
    assert got[b] == expected_greedy(range(20, 32), 2)
    assert got[c] == expected_greedy([9, 9], 2)
    assert got[a] == expected_greedy([1, 2, 3], 6)[1:]  # its first token came from the first run


def test_capacity_one_gives_the_same_events_and_executions_as_a_large_buffer():
    def workload(capacity: int):
        faults = FaultInjector()
        engine = make_engine(block_size=4, max_scheduled_tokens=16, faults=faults)
        requests = [submit(engine, p, n) for p, n in zip(PROMPTS[:5], MAX_NEW[:5], strict=True)]
        events = drain(engine, capacity=capacity)
        return [event_key(e) for e in events], faults.hits[pg_phase("execute")], requests

    big, big_runs, _ = workload(64)
    one, one_runs, _ = workload(1)
    assert one == big
    assert one_runs == big_runs
    # Capacity one: a call either executes one step or drains exactly one retained event.
    faults = FaultInjector()
    engine = make_engine(faults=faults)
    request = submit(engine, [4, 5, 6], 2)
    other = submit(engine, [7, 8], 2)  # keep the handle: a dropped one is abandoned and reclaimed
    hits = faults.hits
    first = engine.run(max_events=1)
    assert len(first) == 1 and hits[pg_phase("execute")] == 1 and engine.stats().pending_events == 1
    second = engine.run(max_events=1)
    assert len(second) == 1 and hits[pg_phase("execute")] == 1 and engine.stats().pending_events == 0
    assert first[0].request is request and second[0].request is other


def pg_phase(name: str):
    from pagedgen.engine.outcomes import Phase

    return Phase(name)


def test_multi_turn_continuation_equals_fresh_request_with_concatenated_tokens():
    steps: list = []
    engine = make_engine(block_size=4, wrap_runner=record_steps(steps))
    p1, p2 = [5, 6, 7, 8, 9], [40, 41, 42]
    request = submit(engine, p1, 5)
    g1 = tokens_of(drain(engine))[request]
    assert g1 == expected_greedy(p1, 5)
    assert request.status is pg.RequestStatus.TURN_COMPLETE
    executed = len(steps)
    assert request.begin_turn(p2, turn_options(request, 6)) == 2
    events = drain(engine)
    g2 = tokens_of(events)[request]
    assert [e.turn_id for e in events] == [2] * 6
    assert g2 == expected_greedy(p1 + g1 + p2, 6)
    # The continuation prefills only the token sampled last (not yet cached) plus the new input.
    assert steps[executed] == ([1 + len(p2)], [len(p1) + len(g1) - 1])
    fresh_engine = make_engine()
    fresh = submit(fresh_engine, p1 + g1 + p2, 6)
    assert tokens_of(drain(fresh_engine))[fresh] == g2
    usage = finishes_of(events)[request][0].usage
    # The history before the replayed token was reused, not recomputed.
    assert usage == pg.Usage(prompt_tokens=3, generated_tokens=6, reused_tokens=len(p1) + len(g1) - 1)
    assert request.tokens == tuple(p1 + g1 + p2 + g2)


def test_continuation_after_eos_prefills_only_new_tokens():
    prompt = [3, 1, 4, 1, 5]
    free_run = expected_greedy(prompt, 8)
    model = pg.SyntheticModel(vocab_size=VOCAB, eos_token_id=free_run[3])
    steps: list = []
    engine = make_engine(model, wrap_runner=record_steps(steps))
    request = submit(engine, prompt, 20)
    events = drain(engine)
    assert tokens_of(events)[request] == free_run[:3]
    assert request.sequence_length == request.processed_length == len(prompt) + 3
    executed = len(steps)
    request.begin_turn([7, 7], turn_options(request, 3))
    events = drain(engine)
    assert steps[executed] == ([2], [len(prompt) + 3])
    assert tokens_of(events)[request] == expected_greedy(prompt + free_run[:3] + [7, 7], 3, eos=free_run[3])


def test_turn_complete_residents_yield_rows_to_waiting_work():
    """Unlike a policy that keeps idle residents (and defers the third request until a close), the least
    recently used idle resident yields its row and blocks, and can still continue later."""
    engine = make_engine(max_batch_size=2, block_size=4, num_blocks=64)
    requests = [submit(engine, [i + 1, i + 2], 3 + i) for i in range(3)]
    buffer = engine.create_event_buffer(16)
    events: list[pg.EngineEvent] = []
    while requests[0].status is not pg.RequestStatus.TURN_COMPLETE:
        events.extend(engine.run(buffer))
    assert requests[2].status is pg.RequestStatus.ASSIGNED
    # Both rows are taken (one by an idle resident): the next call releases the idle one, no capacity event.
    assert list(engine.run(buffer)) == []
    stats = engine.stats()
    assert stats.idle_evictions == 1 and stats.resident_requests == 1 and stats.steps > 0
    assert requests[0].processed_length == 0 and requests[0].status is pg.RequestStatus.TURN_COMPLETE
    events += drain(engine)
    got = tokens_of(events)
    for i, request in enumerate(requests):
        assert got[request] == expected_greedy([i + 1, i + 2], 3 + i)
    # The yielded request continues as if it had stayed resident.
    history = list(requests[0].tokens)
    requests[0].begin_turn([9, 9], turn_options(requests[0], 4))
    assert tokens_of(drain(engine))[requests[0]] == expected_greedy(history + [9, 9], 4)


def test_a_step_with_a_decode_is_bounded_by_max_mixed_step_tokens():
    """A long prompt beside a running stream is prefilled in chunks interleaved with the stream's tokens;
    alone, it takes the whole max_scheduled_tokens."""
    steps: list = []
    engine = make_engine(
        max_scheduled_tokens=16, max_mixed_step_tokens=6, num_blocks=64, wrap_runner=record_steps(steps)
    )
    alone = list(range(30, 50))  # 20 tokens, nothing decodes: 16 + 4
    first = submit(engine, alone, 1)
    assert tokens_of(drain(engine))[first] == expected_greedy(alone, 1)
    assert steps == [([16], [0]), ([4], [16])]
    first.close()
    steps.clear()
    stream = submit(engine, [1, 2, 3], 8)
    engine.run(max_events=8)  # the stream is prefilled and now decodes
    long = list(range(50, 70))  # 20 tokens beside a decode: 5 per step
    late = submit(engine, long, 2)
    events = drain(engine)
    assert steps == [
        ([3], [0]),
        ([1, 5], [3, 0]),
        ([1, 5], [4, 5]),
        ([1, 5], [5, 10]),
        ([1, 5], [6, 15]),  # the long prompt's first token: the stream had 4 more meanwhile
        ([1, 1], [7, 20]),
        ([1], [8]),
        ([1], [9]),
    ]
    got = tokens_of(events)
    assert got[late] == expected_greedy(long, 2)
    assert got[stream] == expected_greedy([1, 2, 3], 8)[1:]
    for request in (stream, late):
        request.close()
    assert engine.stats().free_blocks == 64 and engine.check_invariants() == []


def test_the_mixed_budget_leaves_each_prefill_its_provisional_token():
    """More decodes than the mixed budget: the prefills beside them still advance a token per step."""
    steps: list = []
    engine = make_engine(
        max_scheduled_tokens=16,
        max_mixed_step_tokens=2,
        max_batch_size=4,
        num_blocks=64,
        wrap_runner=record_steps(steps),
    )
    streams = [submit(engine, [4, 5], 6), submit(engine, [6, 7], 6)]
    engine.run(max_events=8)  # both prefilled in one step; both decode now
    late = submit(engine, [8, 9, 10, 11], 1)
    events = drain(engine)
    assert steps[:5] == [([2, 2], [0, 0])] + [([1, 1, 1], [2 + i, 2 + i, i]) for i in range(4)]
    assert tokens_of(events)[late] == expected_greedy([8, 9, 10, 11], 1)
    for request in [*streams, late]:
        request.close()
    assert engine.stats().free_blocks == 64


def test_the_mixed_budget_defaults_to_the_device():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_mixed_step_tokens(pg.EngineConfig(), cpu) == DEFAULT_CPU_MIXED_STEP_TOKENS == 512
    assert resolve_mixed_step_tokens(pg.EngineConfig(), cuda) == 2048
    assert resolve_mixed_step_tokens(pg.EngineConfig(max_scheduled_tokens=300), cpu) == 300
    assert resolve_mixed_step_tokens(pg.EngineConfig(max_mixed_step_tokens=64), cuda) == 64
    assert resolve_mixed_step_tokens(pg.EngineConfig(max_mixed_step_tokens=4096), cpu) == 2048
    engine = make_engine()  # the synthetic model runs on the CPU
    assert engine.parts.scheduler.max_mixed_step_tokens == 512
