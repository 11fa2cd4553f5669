"""Keeping a proposer's drafts pending for the requests an application drives (above the engine).

The engine verifies whatever drafts a caller sets and never proposes; a :class:`DraftDriver` is that caller
for ``pg.LLM`` and the server, with any ``propose(tokens)`` object as its proposer. It proposes only where
drafts pay (small batches) and backs off per request when they are rejected: docs/engine.md, "The draft
driver".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol


class DraftProposer(Protocol):
    """Proposes draft tokens that continue ``tokens`` (the request's whole logical sequence)."""

    def propose(self, tokens: Sequence[int]) -> list[int]: ...


class DraftTarget(Protocol):
    """What the driver reads and sets on a ``pg.Request`` (this package sits below the engine)."""

    @property
    def id(self) -> int: ...

    @property
    def tokens(self) -> Sequence[int]: ...

    @property
    def ready_for_drafts(self) -> bool: ...

    @property
    def draft_tokens(self) -> Sequence[int]: ...

    @property
    def drafts_proposed(self) -> int: ...

    @property
    def drafts_accepted(self) -> int: ...

    def set_draft_tokens(self, draft_tokens: Sequence[int]) -> None: ...


class DraftVerifier(Protocol):
    """What the driver asks of a ``pg.Engine``: how many drafts one proposal may carry."""

    def max_draft_tokens_per_proposal(self) -> int: ...


@dataclass(slots=True)
class _Track:
    """What the driver remembers about one request."""

    proposed: int = 0  # request.drafts_proposed when last seen
    accepted: int = 0  # request.drafts_accepted when last seen
    misses: int = 0  # proposals in a row with nothing accepted
    skip: int = 0  # chances to propose still to skip


class DraftDriver:
    """Sets ``proposer``'s drafts on ready requests before each step; counts what it proposed."""

    def __init__(
        self, engine: DraftVerifier, proposer: DraftProposer, max_backoff: int = 16, max_batch: int = 4
    ):
        self.engine = engine
        self.proposer = proposer
        self.max_backoff = max_backoff
        self.max_batch = max_batch
        self.limit = engine.max_draft_tokens_per_proposal()
        self._tracks: dict[int, _Track] = {}

    def propose(self, requests: Iterable[DraftTarget]) -> None:
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

    def forget(self, request: DraftTarget) -> None:
        """Drop what the driver tracks for a finished request."""
        self._tracks.pop(request.id, None)

    def _observe(self, request: DraftTarget) -> _Track:
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
