"""Injectable step failures: a test arms a named phase and the next step that reaches it raises.

Every phase checks its fault point on entry (a dict lookup when nothing is armed), which is how the tests
prove each phase's documented outcome; a test hands its own :class:`FaultInjector` to the engine through
``build_engine_parts(..., faults=...)``. Request-tied, attributed, recurring faults and held guidance masks:
docs/engine.md, "Fault injection".
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from dataclasses import dataclass

from pagedgen.engine.outcomes import Phase
from pagedgen.errors import InjectedFault, InvalidArgumentError, RequestFailure


@dataclass(slots=True)
class _Armed:
    error: BaseException
    remaining: int | None  # None: forever
    request_id: int | None = None  # fire only in steps that schedule this request
    attributed: bool = False  # raise as this request's own failure (RequestFailure)


class FaultInjector:
    """Named fault points. ``arm("execute", RetryableExecutionError("x"), times=2)`` fails the next two
    executions; ``hits[phase]`` counts how often each phase was reached (armed or not)."""

    def __init__(self) -> None:
        self._armed: dict[Phase, _Armed] = {}
        self.hits: dict[Phase, int] = {phase: 0 for phase in Phase}
        self._held_masks: dict[int, threading.Event] = {}

    def arm(
        self,
        phase: Phase | str,
        error: BaseException | None = None,
        times: int | None = 1,
        *,
        request_id: int | None = None,
        attributed: bool = False,
    ) -> None:
        try:
            phase = Phase(phase)
        except ValueError as exc:
            names = ", ".join(p.value for p in Phase)
            raise InvalidArgumentError(f"unknown fault phase {phase!r}; phases: {names}") from exc
        if times is not None and times < 1:
            raise InvalidArgumentError(f"times must be None (forever) or >= 1, got {times}")
        if attributed and request_id is None:
            raise InvalidArgumentError("an attributed fault needs the request_id it is attributed to")
        error = error or InjectedFault(f"injected fault at phase {phase.value!r}")
        self._armed[phase] = _Armed(error, times, request_id, attributed)

    def disarm(self) -> None:
        self._armed.clear()

    def hold_masks(self, request_id: int, gate: threading.Event) -> None:
        """Make every guidance mask of ``request_id`` wait for ``gate`` (at most a minute) before it is
        computed."""
        self._held_masks[request_id] = gate

    def hold_mask(self, request_id: int) -> None:
        """The mask pool's hook: wait while ``request_id``'s masks are held (a dict lookup otherwise)."""
        gate = self._held_masks.get(request_id)
        if gate is not None:
            gate.wait(timeout=60.0)

    @property
    def armed(self) -> bool:
        return bool(self._armed)

    def check(self, phase: Phase, request_ids: Collection[int] = ()) -> None:
        """Raise the armed error of ``phase`` (once per arming count); otherwise do nothing.

        ``request_ids`` are the requests the step schedules; a request-tied fault fires only among them.
        """
        self.hits[phase] += 1
        armed = self._armed.get(phase)
        if armed is None or (armed.request_id is not None and armed.request_id not in request_ids):
            return
        if armed.remaining is not None:
            armed.remaining -= 1
            if armed.remaining == 0:
                del self._armed[phase]
        error = armed.error.with_traceback(None)  # a recurring fault must not grow one traceback forever
        if armed.attributed:
            error = RequestFailure(armed.request_id, error)
        armed = None
        try:
            raise error
        finally:  # no frame-local reference: error -> traceback -> this frame -> error would be a cycle
            del error
