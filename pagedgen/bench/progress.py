"""Progress lines while a bench run generates: a run of minutes must not look like a hang.

A run logs one line at most every ``interval_s`` seconds (tokens generated of the total, requests
finished, elapsed time), plain lines rather than a redrawn bar, so they read the same in a terminal and
in a log file. The clock is injectable so the throttling is tested without sleeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

PROGRESS_INTERVAL_S = 10.0


@dataclass(slots=True)
class ProgressLine:
    """Counts a run's generated tokens and finished requests and logs them, throttled."""

    label: str
    total_tokens: int
    total_requests: int
    log: Callable[[str], None]
    interval_s: float = PROGRESS_INTERVAL_S
    clock: Callable[[], float] = time.perf_counter
    tokens: int = 0
    finished: int = 0
    _start: float = field(init=False, default=0.0)
    _last: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        self._start = self._last = self.clock()

    def advance(self, tokens: int = 0, finished: int = 0) -> None:
        """Adds what one engine step produced; logs a line when ``interval_s`` has passed since the last."""
        self.tokens += tokens
        self.finished += finished
        now = self.clock()
        if now - self._last >= self.interval_s:
            self._last = now
            self.log(self.line(now))

    def line(self, now: float) -> str:
        elapsed = now - self._start
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        return (
            f"  {self.label:<14} ... {self.tokens}/{self.total_tokens} tokens, "
            f"{self.finished}/{self.total_requests} requests done, {elapsed:.0f} s ({rate:.1f} tok/s)"
        )
