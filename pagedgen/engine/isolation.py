"""Failure isolation: a step that keeps rolling back must not stall the engine.

The reference retries a rolled-back step as is, so a failure that recurs for the same batch (one request's
input trips the model, a processor, or the host allocator every time) would roll back forever and starve
every request batched with it. The rule, next to the seed's rollback rules (docs: "Failure isolation"):

* A failure attributed to one request (its sampling row, its stop matcher) fails only that turn at once;
  that is the step's job (:class:`pagedgen.engine.outcomes.RequestFailure`), not this module's.
* An unattributed rollback (RETRYABLE or an execution CAPACITY_BLOCKED) is retried as is up to
  ``max_retries`` times in a row: a transient fault clears and nothing is lost.
* After that the requests of the failing step become *suspects*: the next steps schedule only the first
  half of them; a half that still fails ``max_retries`` times is halved again, a half that commits clears
  its requests and the other half is tried next. A single request that fails ``max_retries`` times alone is
  the culprit: its turn fails with ``REQUEST_FAILED`` and the search goes on with what is left.

Every rollback therefore either retries (at most ``max_retries`` times per scope), shrinks the scope, or
fails one turn, so a recurring failure costs at most ``max_retries * (2 * batch - 1)`` rolled-back steps per
culprit and can never spin the engine without progress. Requests outside the suspects wait meanwhile (the
search is short and bounded). Pure bookkeeping over request ids: the step plans, rolls back and fails turns.
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
