"""Failure isolation: a step that keeps rolling back must not stall the engine.

Retrying a rolled-back step as is clears a transient fault, but a failure that recurs with the same batch
would roll back forever and starve every request batched with it. So an unattributed rollback is retried
up to ``max_retries`` times, then the failing step's requests become suspects and are halved until the one
that fails alone is found and its turn fails with ``REQUEST_FAILED``; a recurring failure therefore costs at
most ``max_retries * (2 * batch - 1)`` rolled-back steps. Pure bookkeeping over request ids: the step plans,
rolls back and fails turns. The rules: docs/engine.md, "Failure isolation".
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MAX_STEP_RETRIES = 3


@dataclass(slots=True)
class FailureIsolator:
    """Counts consecutive rollbacks and narrows the requests the next plan may schedule."""

    max_retries: int = DEFAULT_MAX_STEP_RETRIES
    failures: int = 0  # consecutive rollbacks of the current scope
    suspects: tuple[int, ...] | None = None  # request ids the next plan may schedule; None: everyone
    untested: list[tuple[int, ...]] = field(default_factory=list)  # halves still to try, last first

    @property
    def active(self) -> bool:
        return self.suspects is not None

    def allowed(self) -> frozenset[int] | None:
        """The request ids the next step may schedule (None: no restriction)."""
        return None if self.suspects is None else frozenset(self.suspects)

    def on_rollback(self, scheduled: list[int]) -> int | None:
        """A step over ``scheduled`` (request ids, plan order) rolled back without attribution.

        Returns the request id to fail as the culprit, or None when the step should just be retried.
        """
        self.failures += 1
        if self.failures < self.max_retries or not scheduled:
            return None
        self.failures = 0
        if len(scheduled) == 1:
            self._next_scope()
            return scheduled[0]
        half = (len(scheduled) + 1) // 2
        self.untested.append(tuple(scheduled[half:]))
        self.suspects = tuple(scheduled[:half])
        return None

    def on_progress(self) -> None:
        """A step committed, or the scope has nothing left to schedule: move on to the next untested half."""
        self.failures = 0
        if self.suspects is not None:
            self._next_scope()

    def forget(self, request_id: int) -> None:
        """A request left the engine (failed, cancelled, closed): it is no longer a suspect."""
        if self.suspects is not None:
            self.suspects = tuple(r for r in self.suspects if r != request_id)
        self.untested = [
            kept for kept in (tuple(r for r in s if r != request_id) for s in self.untested) if kept
        ]

    def _next_scope(self) -> None:
        self.suspects = self.untested.pop() if self.untested else None
