"""Draft policies for the synthetic engine tests: correct, wrong or partly correct drafts, and the loop
that proposes them whenever a request is ready for drafts."""

from __future__ import annotations

from collections.abc import Callable

import pagedgen as pg
from pagedgen.models.synthetic import synthetic_greedy

F = pg.EngineEventFlags

Policy = Callable[[pg.Request], list[int]]


def truth(request: pg.Request, k: int) -> list[int]:
    """The next ``k`` greedy tokens of the request's committed sequence (EOS included, as a token)."""
    return synthetic_greedy(list(request.tokens), k, request._engine.model.vocab_size)


def correct(k: int) -> Policy:
    return lambda r: truth(r, k)


def wrong(k: int) -> Policy:
    return lambda r: [(t + 1) % r._engine.model.vocab_size for t in truth(r, k)]


def partly(j: int, k: int) -> Policy:
    """The first ``j`` of ``k`` drafts are right, the rest wrong."""
    return lambda r: truth(r, j) + wrong(k - j)(r)[j:]


def run_with(
    engine: pg.Engine, policies: dict[pg.Request, Policy], capacity: int = 64, close_finished: bool = False
) -> list[pg.EngineEvent]:
    """The public engine loop, proposing each policy's drafts whenever its request is ready for them
    (``close_finished``: close each request at its terminal event, freeing its blocks for the others)."""
    buffer = engine.create_event_buffer(capacity)
    events: list[pg.EngineEvent] = []
    for _ in range(10_000):
        if not engine.has_pending_requests():
            return events
        for request, policy in policies.items():
            if request.status is not pg.RequestStatus.CLOSED and request.ready_for_drafts:
                request.set_draft_tokens(policy(request)[: engine.max_draft_tokens_per_proposal()])
        batch = list(engine.run(buffer))
        events += batch
        for event in batch:
            if close_finished and event.flags & F.TURN_FINISHED:
                event.request.close()
        assert engine.check_invariants() == []
    raise AssertionError("no progress")
