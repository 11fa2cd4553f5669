"""What the engine-level family tests against transformers share (tests/model/test_model_*.py).

Prompt ids, the small engine every case runs on, the whole-sequence greedy oracle and the recoverable faults
injected at every phase.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

import pagedgen as pg
from pagedgen.core.window_geometry import ring_blocks
from tests.helpers import (
    drain,
    engine_snapshot,
    event_key,
    make_engine,
    record_steps,
    submit,
    tokens_of,
)


def ids_of(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 260, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def small_engine(model: Any, **config: Any) -> pg.Engine:
    """Small blocks and chunks, so a few dozen tokens cross many blocks, chunks and ring turns."""
    config = {"block_size": 4, "num_blocks": 96, "chunk_size": 5, "max_batch_size": 4, **config}
    return make_engine(model, **config)


def greedy_by_forwards(hf: Any, ids: Sequence[int], n: int) -> list[int]:
    """Greedy continuation by whole-sequence forwards (no cache: the oracle of every step)."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids) :]


# ---- engine-level checks every family runs (each family's test module calls them under its own names) ---


class FamilyCase(Protocol):
    """What a family's test case carries: the pagedgen model and its transformers oracle of greedy tokens."""

    model: pg.Model

    def greedy(self, ids: Sequence[int], n: int) -> list[int]: ...


def check_greedy_and_slot_returns(case: FamilyCase) -> None:
    """A fixed-state model's greedy tokens equal transformers'; its slot is held while the request is
    resident and returns, with every block, on close."""
    prompt, n = ids_of(24, seed=1), 40
    eng = small_engine(case.model)
    request = submit(eng, prompt, n, ignore_eos=True)
    assert tokens_of(drain(eng))[request] == case.greedy(prompt, n)
    stats = eng.stats()
    assert (stats.fixed_total_slots, stats.fixed_free_slots) == (4, 3)
    assert eng.parts.cache.fixed.committed_tokens(request.id) == request.processed_length
    request.close()
    stats = eng.stats()
    assert stats.fixed_free_slots == 4 and stats.free_blocks == stats.total_blocks


def check_greedy_with_flat_window(case: FamilyCase, window: int) -> list[int]:
    """A windowed model's greedy tokens equal transformers' over 120 tokens while its window layers keep one
    ring of constant size and the full pool grows; every block returns on close. Returns the tokens."""
    prompt, n = ids_of(24, seed=1), 96
    eng = small_engine(case.model)
    request = submit(eng, prompt, n, ignore_eos=True)
    cache = eng.parts.cache
    rings, window_free, full_blocks, tokens = [], [], [], []
    buffer = eng.create_event_buffer(16)
    while eng.has_pending_requests():
        tokens += [e.token for e in eng.run(buffer) if e.flags & pg.EngineEventFlags.TOKEN]
        if cache.is_resident(request.id):
            rings.append(cache.window_ring(request.id))
            window_free.append(eng.stats().window_free_blocks)
            full_blocks.append(len(cache.block_table(request.id)))
    assert tokens == case.greedy(prompt, n)
    r = ring_blocks(5, window, 4)
    assert len(set(rings)) == 1 and len(rings[0]) == r  # one ring, never grown, never replaced
    stats = eng.stats()
    assert set(window_free) == {stats.window_total_blocks - r} and stats.window_total_blocks == 4 * r
    assert full_blocks[-1] == 30 > full_blocks[0]  # the full pool grows with the sequence (120 tokens / 4)
    request.close()
    stats = eng.stats()
    assert (stats.free_blocks, stats.window_free_blocks) == (stats.total_blocks, stats.window_total_blocks)
    return tokens


def check_mixed_batch(case: FamilyCase, lengths: Sequence[tuple[int, int]]) -> None:
    """Requests of ``lengths`` (prompt length, generated tokens) run together in chunked, mixed prefill +
    decode steps give each the tokens it gets alone, and the last equals transformers' greedy."""
    prompts = [ids_of(length, seed=10 + i) for i, (length, _) in enumerate(lengths)]
    alone = []
    for prompt, (_, n) in zip(prompts, lengths, strict=True):
        eng = small_engine(case.model)
        request = submit(eng, prompt, n, ignore_eos=True)
        alone.append(tokens_of(drain(eng))[request])
    steps: list = []
    eng = small_engine(case.model, max_scheduled_tokens=12, wrap_runner=record_steps(steps))  # chunked, mixed
    requests = [submit(eng, p, n, ignore_eos=True) for p, (_, n) in zip(prompts, lengths, strict=True)]
    together = tokens_of(drain(eng))
    assert [together[r] for r in requests] == alone
    assert any(len(q_lens) == 3 and max(q_lens) > 1 and min(q_lens) == 1 for q_lens, _ in steps)
    assert alone[-1] == case.greedy(prompts[-1], lengths[-1][1])


def check_chunked_equals_unchunked(case: FamilyCase) -> None:
    """A 50-token prompt in chunks of 3 and in one step (chunk None: C is the token budget) give the same
    tokens, transformers' greedy ones."""
    prompt = ids_of(50, seed=3)
    outputs = []
    for chunk in (3, None):
        steps: list = []
        eng = small_engine(case.model, chunk_size=chunk, max_batch_size=2, wrap_runner=record_steps(steps))
        request = submit(eng, prompt, 20, ignore_eos=True)
        outputs.append(tokens_of(drain(eng))[request])
        assert steps[0][0] == [3 if chunk else 50]
    assert outputs[0] == outputs[1] == case.greedy(prompt, 20)


def check_second_turn(case: FamilyCase) -> None:
    """A second turn continues the fixed state the first left: its tokens equal transformers' greedy over
    the whole conversation so far."""
    first, second = ids_of(9, seed=6), ids_of(5, seed=7)
    eng = small_engine(case.model)
    request = submit(eng, first, 6, ignore_eos=True)
    out = tokens_of(drain(eng))[request]
    options = pg.TurnOptions(request)
    options.set_max_generated_tokens(8)
    request.begin_turn(second, options)
    assert tokens_of(drain(eng))[request] == case.greedy(first + out + second, 8)


def resident_pair(
    model: pg.Model, generate: int, steps: int, past: int
) -> tuple[pg.Engine, list[pg.Request]]:
    """A request decoding (``generate`` tokens, run ``steps`` steps, now past ``past`` tokens) and a partial
    prefill of 23 tokens, both resident: the state a faulted step must leave exactly as it found it."""
    eng = small_engine(model, max_scheduled_tokens=8)
    requests = [submit(eng, ids_of(10, seed=4), generate, ignore_eos=True)]
    for _ in range(steps):
        eng.run(max_events=64)
    requests.append(submit(eng, ids_of(23, seed=5), 6, ignore_eos=True))
    eng.run(max_events=64)
    assert 0 < requests[1].processed_length < 23 and requests[0].processed_length > past
    return eng, requests


Scenario = Callable[[], tuple[pg.Engine, list[pg.Request]]]


def check_rollback_at(
    scenario: Scenario, phase: str, error: BaseException, check_before: Callable[[dict], None]
) -> None:
    """A recoverable ``error`` at ``phase`` rolls the step back: one engine event, the snapshot (which
    ``check_before`` first checks holds the family's live state) unchanged, and the retry's events equal
    those of a run never faulted."""
    reference, _ = scenario()
    expected = [event_key(e) for e in drain(reference)]
    eng, _ = scenario()
    faults = eng.parts.faults
    before = engine_snapshot(eng)
    check_before(before)
    faults.arm(phase, error)
    (event,) = eng.run(max_events=64)
    assert event.request is None and event.flags & (
        pg.EngineEventFlags.RETRYABLE | pg.EngineEventFlags.CAPACITY_BLOCKED
    )
    assert engine_snapshot(eng) == before and eng.check_invariants() == []
    assert [event_key(e) for e in drain(eng)] == expected  # the retry starts from exactly the same state


def check_fatal_step(scenario: Scenario, phase: str, pool: tuple[str, str]) -> None:
    """A fatal fault at ``phase`` fails every turn and leaves the engine unhealthy; on close every block and
    every unit of the family's second pool (``pool``: its free and total stats fields) returns."""
    eng, requests = scenario()
    faults = eng.parts.faults
    faults.arm(phase)
    drain(eng)
    assert not eng.stats().healthy
    assert all(r.status is pg.RequestStatus.TURN_COMPLETE for r in requests)
    for request in requests:
        request.close()
    stats = eng.stats()
    free, total = pool
    assert (stats.free_blocks, getattr(stats, free)) == (stats.total_blocks, getattr(stats, total))
