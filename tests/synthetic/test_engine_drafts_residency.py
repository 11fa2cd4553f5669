"""Speculative drafts together with prefix caching and residency release (issues 14 and 15).

- A commit narrowed to the accepted drafts publishes only blocks full of committed tokens: a block that only
  rejected drafts filled stays unnamed, so a later request whose prompt *is* the rejected continuation misses
  it and computes it, with exact tokens.
- A preempted request loses its pending drafts (they were proposed after a token its re-prefill processes
  anew); it cannot take new ones until it decodes again, and its tokens stay exactly the greedy ones.
- Drafts take only what the selection left of the pool: evictable cached blocks count, like for any
  allocation, but drafts never defer or preempt anyone.
- An idle resident that yields after verifying drafts continues exactly.

The synthetic model reads its inputs back through the block table, so a wrongly published, shared or evicted
block changes the tokens.
"""

from __future__ import annotations

import pytest

import pagedgen as pg
from pagedgen.models.synthetic import synthetic_greedy
from tests import helpers
from tests.helpers import (
    SyntheticFamily,
    drain,
    expected_greedy,
    finishes_of,
    make_engine,
    submit,
    tokens_of,
    turn_options,
)
from tests.helpers.drafts import Policy, correct, partly, run_with, wrong

F = pg.EngineEventFlags


def named_blocks(engine: pg.Engine) -> dict[int, bytes]:
    """Block -> digest of every block the prefix cache names."""
    return {block: digest for digest, block in engine.parts.cache.prefix.entries().items()}


def prompt(i: int, n: int) -> list[int]:
    return [(13 * i + 7 * j + 1) % helpers.VOCAB for j in range(n)]


def test_a_block_filled_only_by_rejected_drafts_is_never_published():
    engine = make_engine(block_size=4)
    first = submit(engine, [3, 4, 5], 12)
    buffer = engine.create_event_buffer(64)
    events = list(engine.run(buffer))  # the prefill: 3 processed, one sampled token to decode
    assert first.ready_for_drafts and first.sequence_length == 4
    rejected = [(t + 1) % helpers.VOCAB for t in synthetic_greedy(list(first.tokens), 4, helpers.VOCAB)]
    first.set_draft_tokens(rejected)
    events += engine.run(buffer)  # the decode at 3 verifies drafts at 4..7, filling block 1: all rejected
    assert (first.drafts_proposed, first.drafts_accepted) == (4, 0)
    assert first.processed_length == 4 and first.sequence_length == 5
    table = engine.parts.cache.block_table(first.id)
    assert len(table) == 2  # the drafts' block stays with the request, past its committed length
    assert set(named_blocks(engine)) == {table[0]}  # block 0 is full of committed tokens, block 1 is not
    # A request whose prompt is exactly the rejected continuation finds block 0 only, and is exact.
    guess = list(first.tokens)[:4] + rejected + [9]
    second = submit(engine, guess, 6)
    events += drain(engine)
    assert tokens_of(events)[second] == expected_greedy(guess, 6)
    assert finishes_of(events)[second][0].usage.cached_prompt_tokens == 4
    assert tokens_of(events)[first] == expected_greedy([3, 4, 5], 12)
    assert engine.check_invariants() == []


@pytest.mark.parametrize("kind", ["correct", "wrong", "partly"])
@pytest.mark.parametrize("k", [3, 8])
def test_blocks_published_at_narrowed_commits_serve_later_requests_exactly(kind, k):
    """Every block a drafted decode filled and published holds its accepted tokens: a later request that
    re-sends the whole conversation hits them all and gets exactly the greedy tokens, as without caching."""
    policy: Policy = {"correct": correct(k), "wrong": wrong(k), "partly": partly(1, k)}[kind]
    outputs = {}
    for caching in (False, True):
        engine = make_engine(block_size=4, prefix_caching=caching)
        first = submit(engine, prompt(1, 5), 30)
        events = run_with(engine, {first: policy})
        history = prompt(1, 5) + tokens_of(events)[first]
        assert first.drafts_proposed > 0
        assert (first.drafts_accepted == 0) is (kind == "wrong")
        second = submit(engine, history + [2, 3], 10)
        later = drain(engine)
        outputs[caching] = (history, tokens_of(later)[second])
        (finish,) = finishes_of(later)[second]
        if caching:  # everything the first request committed in full blocks was published and is hit
            assert finish.usage.cached_prompt_tokens == (len(history) - 1) // 4 * 4
        assert engine.check_invariants() == []
    history, got = outputs[True]
    assert outputs[False] == outputs[True]
    assert history == prompt(1, 5) + expected_greedy(prompt(1, 5), 30)
    assert got == expected_greedy(history + [2, 3], 10)


@pytest.fixture(params=[(None, True), (None, False), (3, False)], ids=["cached", "uncached", "window3"])
def variant(request) -> tuple[SyntheticFamily, bool]:
    """The synthetic model the test runs on, and whether prefix caching is on."""
    window, caching = request.param
    return SyntheticFamily(window), caching


def test_a_preempted_request_drops_its_drafts_and_stays_exact(variant):
    """Six blocks of 4 slots, four rows, every decode proposing drafts: preemption hits requests with
    drafts pending; they come back with none, refuse new ones while waiting, and emit exactly their tokens."""
    family, caching = variant
    engine = family.engine(max_batch_size=4, block_size=4, num_blocks=6, prefix_caching=caching)
    prompts = [prompt(i, 4 + i % 5) for i in range(8)]
    requests = [submit(engine, p, 8) for p in prompts]
    policies = [correct(3), wrong(3), partly(1, 3)]
    buffer = engine.create_event_buffer(64)
    events: list[pg.EngineEvent] = []
    dropped = 0
    for _ in range(2000):
        if not engine.has_pending_requests():
            break
        proposed = []
        for i, request in enumerate(requests):
            if request.ready_for_drafts:
                request.set_draft_tokens(policies[i % 3](request))
                proposed.append(request)
        events += engine.run(buffer)
        for request in proposed:
            if request.status is pg.RequestStatus.ASSIGNED:  # preempted with its drafts pending
                dropped += 1
                assert request.draft_tokens == () and request.processed_length == 0
                with pytest.raises(pg.EngineError):
                    request.set_draft_tokens([1])
        assert engine.check_invariants() == []
    else:
        raise AssertionError("no progress")
    assert dropped > 0 and engine.stats().preemptions > 0
    got = tokens_of(events)
    for request, p in zip(requests, prompts, strict=True):
        assert got[request] == family.greedy(p, 8)
        assert len(finishes_of(events)[request]) == 1
    stats = engine.stats()
    assert stats.drafts_proposed == sum(r.drafts_proposed for r in requests) > 0
    assert stats.drafts_accepted == sum(r.drafts_accepted for r in requests) > 0


def test_drafts_use_evictable_cached_blocks_but_never_preempt():
    """With no FREE block left, a decode's drafts take an unpinned cached block (evicting it, as any
    allocation would); they never defer, preempt or make another request yield."""
    engine = make_engine(max_batch_size=2, block_size=4, num_blocks=4)
    filler = submit(engine, prompt(7, 12), 1)  # 13 tokens: 3 full blocks, published
    drain(engine)
    filler.close()
    stats = engine.stats()
    assert stats.cached_blocks == 3 and engine.parts.cache.pool.num_free == 1
    request = submit(engine, [3, 4, 5], 10)
    buffer = engine.create_event_buffer(64)
    engine.run(buffer)  # prefill: takes the one FREE block
    assert engine.parts.cache.pool.num_free == 0
    request.set_draft_tokens(correct(4)(request))  # positions 4..7: block 1, only a cached block is left
    engine.run(buffer)
    assert (request.drafts_proposed, request.drafts_accepted) == (4, 4)
    assert engine.stats().cached_blocks == 2  # one evicted for the drafts
    events = run_with(engine, {request: correct(4)})
    stats = engine.stats()
    assert stats.preemptions == 0 and stats.idle_evictions == 0
    assert list(request.tokens[3:]) == expected_greedy([3, 4, 5], 10)
    assert not any(e.flags & F.CAPACITY_BLOCKED for e in events)
    assert engine.check_invariants() == []


def test_idle_residents_that_verified_drafts_yield_and_continue_exactly():
    """Two rows, six requests: each verifies drafts (some rejected, their blocks kept past the committed
    length), finishes its turn and stays resident; later ones make them yield; every continuation is exact."""
    engine = make_engine(max_batch_size=2, block_size=4, num_blocks=64)
    prompts = [prompt(i, 5 + i) for i in range(6)]
    requests = [submit(engine, p, 9) for p in prompts]
    policies = {r: [correct(4), wrong(4), partly(2, 4)][i % 3] for i, r in enumerate(requests)}
    events = run_with(engine, policies)
    got = tokens_of(events)
    assert all(got[r] == expected_greedy(p, 9) for r, p in zip(requests, prompts, strict=True))
    assert engine.stats().idle_evictions >= 4
    assert all(r.draft_tokens == () for r in requests)
    for r in requests:
        r.begin_turn([1, 2], turn_options(r, 6))
    events = run_with(engine, policies)
    got = tokens_of(events)
    for r, p in zip(requests, prompts, strict=True):
        history = p + expected_greedy(p, 9) + [1, 2]
        assert got[r] == expected_greedy(history, 6)
    assert sum(r.drafts_accepted for r in requests) > 0
    assert engine.check_invariants() == []
