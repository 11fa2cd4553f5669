"""Keeping a proposer's drafts pending for the requests an application drives (above the engine).

The engine verifies whatever drafts a caller sets (``request.set_draft_tokens``); it never proposes. A
:class:`DraftDriver` is that caller for the helpers (``pg.LLM``, the server): before each ``engine.run`` it
asks its proposer for every request that is ready for drafts and has none pending. Any object with a
``propose(tokens) -> list[int]`` method is a proposer, so the n-gram proposer is replaceable.

Drafts pay where a step's cost hardly depends on its rows: a small batch, whose decode is bound by reading
the weights. In a large batch every verification row costs about as much as a decode row, and the step
still waits for its slowest request, so ``max_batch`` (default 4) turns proposing off while more requests
than that are decoding. A rejected proposal costs its verification rows (and takes a pure-decode step off
the fused decode path), so the driver also backs off per request: after ``m`` proposals in a row of which
nothing was accepted it skips the next ``min(2 ** (m - 1), max_backoff)`` chances to propose; any accepted
draft resets it. That keeps workloads whose drafts are rarely right close to their speed without drafts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class DraftProposer(Protocol):
    """Proposes draft tokens that continue ``tokens`` (the request's whole logical sequence)."""

    def propose(self, tokens: Sequence[int]) -> list[int]: ...


@dataclass(slots=True)
class _Track:
    """What the driver remembers about one request."""

    proposed: int = 0  # request.drafts_proposed when last seen
    accepted: int = 0  # request.drafts_accepted when last seen
    misses: int = 0  # proposals in a row with nothing accepted
    skip: int = 0  # chances to propose still to skip


class DraftDriver:
    """Sets ``proposer``'s drafts on ready requests before each step; counts what it proposed."""

    def __init__(self, engine: Any, proposer: DraftProposer, max_backoff: int = 16, max_batch: int = 4):
        self.engine = engine
        self.proposer = proposer
        self.max_backoff = max_backoff
        self.max_batch = max_batch
        self.limit = engine.max_draft_tokens_per_proposal()
        self._tracks: dict[int, _Track] = {}

    def propose(self, requests: Iterable[Any]) -> None:
        """Give every ready request without a pending proposal the proposer's drafts (owner thread)."""
        if self.limit == 0:
            return
        ready = [r for r in requests if r.ready_for_drafts]
        if len(ready) > self.max_batch:
            return
        for request in ready:
            if request.draft_tokens:
                continue
            track = self._observe(request)
            if track.skip:
                track.skip -= 1
                continue
            drafts = self.proposer.propose(request.tokens)[: self.limit]
            if drafts:
                request.set_draft_tokens(drafts)

    def forget(self, request: Any) -> None:
        """Drop what the driver tracks for a finished request."""
        self._tracks.pop(request.id, None)

    def _observe(self, request: Any) -> _Track:
        """Update the back-off from the request's counters since the last look."""
        track = self._tracks.setdefault(request.id, _Track())
        proposed, accepted = request.drafts_proposed, request.drafts_accepted
        if proposed > track.proposed:  # a proposal was verified since
            if accepted > track.accepted:
                track.misses = 0
            else:
                track.misses += 1
                track.skip = min(2 ** (track.misses - 1), self.max_backoff)
        track.proposed, track.accepted = proposed, accepted
        return track
