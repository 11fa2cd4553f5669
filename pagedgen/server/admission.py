"""Bounded admission: how many completion requests the server holds at once, counted on the event loop.

Without a bound, a burst of requests piles up in the worker's command queue and in the engine's queue; every
one of them holds a connection, a tokenized prompt and an asyncio queue, and all of them time out together.
The server instead admits a request only while fewer than ``max_running + max_queued`` are in flight
(admitted, response not yet ended): ``max_running`` is the engine's ``max_batch_size`` (what it can run at
once) and ``max_queued`` the ``--max-queued-requests`` that may wait beyond a full batch, as in vLLM. A
request past the bound gets 429 with ``Retry-After`` before its prompt is tokenized.

A server that is shutting down closes its admission: from then on every request is refused (503, not 429:
retrying here will not help) while the admitted ones finish.

The count lives on the event loop only (no lock): a ticket is taken by a route and released once, when its
response ends, whichever way it ends. A request for ``n`` choices runs ``n`` engine requests, so its ticket
holds ``n`` places (all or none).
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
    """The in-flight count and its bound (see the module docstring); used from the event loop only."""

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
