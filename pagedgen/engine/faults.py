"""Injectable step failures: a test arms a named phase and the next step that reaches it raises.

Every phase of the transaction calls :meth:`FaultInjector.check` on entry (a dict lookup when nothing is
armed). This is how the tests prove each phase's documented outcome: rollback to identical state, a
CAPACITY_BLOCKED or RETRYABLE engine event, or fail-stop. Production engines simply never arm anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedgen.engine.errors import InvalidArgumentError
from pagedgen.engine.outcomes import Phase


class InjectedFault(RuntimeError):
    """The default error of an armed phase: an *unknown* failure (no retryable/capacity meaning)."""


@dataclass(slots=True)
class _Armed:
    error: BaseException
    remaining: int


class FaultInjector:
    """Named fault points. ``arm("execute", RetryableExecutionError("x"), times=2)`` fails the next two
    executions; ``hits[phase]`` counts how often each phase was reached (armed or not)."""

    def __init__(self) -> None:
        self._armed: dict[Phase, _Armed] = {}
        self.hits: dict[Phase, int] = {phase: 0 for phase in Phase}

    def arm(self, phase: Phase | str, error: BaseException | None = None, times: int = 1) -> None:
        try:
            phase = Phase(phase)
        except ValueError as exc:
            names = ", ".join(p.value for p in Phase)
            raise InvalidArgumentError(f"unknown fault phase {phase!r}; phases: {names}") from exc
        if times < 1:
            raise InvalidArgumentError(f"times must be >= 1, got {times}")
        self._armed[phase] = _Armed(error or InjectedFault(f"injected fault at phase {phase.value!r}"), times)

    def disarm(self) -> None:
        self._armed.clear()

    @property
    def armed(self) -> bool:
        return bool(self._armed)

    def check(self, phase: Phase) -> None:
        """Raise the armed error of ``phase`` (once per arming count); otherwise do nothing."""
        self.hits[phase] += 1
        armed = self._armed.get(phase)
        if armed is None:
            return
        armed.remaining -= 1
        if armed.remaining == 0:
            del self._armed[phase]
        error, armed = armed.error, None
        try:
            raise error
        finally:  # no frame-local reference: error -> traceback -> this frame -> error would be a cycle
            del error
