"""Bounded admission: how many completion requests the server holds at once, counted on the event loop.

Without a bound a burst piles up in the worker's and the engine's queues, every request holding a
connection, a tokenized prompt and a queue, and all of them time out together; so a request past
``max_batch_size + max_queued_requests`` in flight gets 429 before its prompt is tokenized, and a draining
server refuses with 503. docs/server.md, "Errors" (429, 503) and "Shutdown", has the rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MAX_QUEUED_REQUESTS = 256
RETRY_AFTER_S = 1  # the Retry-After of a 429: a batch of short turns drains in about that long


@dataclass(slots=True)
class Ticket:
    """One admitted request's places (``count``, its choices); ``release()`` is idempotent so every exit
    path may call it."""

    _admission: Admission | None
    count: int = 1

    def release(self) -> None:
        if self._admission is not None:
            self._admission.in_flight -= self.count
            self._admission = None


@dataclass(slots=True)
class Admission:
    """The in-flight count and its bound; used from the event loop only (no lock).

    A request is in flight from its admission until its response ends, whichever way it ends: its ticket is
    released once. ``max_running`` is the engine's ``max_batch_size``, ``max_queued`` what may wait beyond a
    full batch (vLLM's ``--max-queued-requests``); a request for ``n`` choices runs ``n`` engine requests, so
    its ticket holds ``n`` places (all or none). Once ``closed`` (a shutdown), every request is refused.
    """

    max_running: int
    max_queued: int
    in_flight: int = field(default=0)
    closed: bool = field(default=False)

    def __post_init__(self) -> None:
        if self.max_running < 1:
            raise ValueError(f"Admission.max_running must be >= 1, got {self.max_running}")
        if self.max_queued < 0:
            raise ValueError(f"Admission.max_queued must be >= 0, got {self.max_queued}")

    @property
    def capacity(self) -> int:
        return self.max_running + self.max_queued

    @property
    def waiting(self) -> int:
        """Admitted requests beyond a full batch: what ``max_queued`` bounds."""
        return max(self.in_flight - self.max_running, 0)

    def close(self) -> None:
        """Admit nothing from now on (the server drains); tickets already held release as before."""
        self.closed = True

    def admit(self, count: int = 1) -> Ticket | None:
        """A ticket for ``count`` places, or None when closed or fewer than ``count`` of ``capacity`` are
        free (the caller answers 503 or 429)."""
        if count < 1:
            raise ValueError(f"Admission.admit count must be >= 1, got {count}")
        if self.closed or self.in_flight + count > self.capacity:
            return None
        self.in_flight += count
        return Ticket(self, count)
