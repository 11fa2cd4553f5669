"""Peak resident memory of the process while one system runs.

Linux keeps the high-water mark in ``VmHWM`` of ``/proc/self/status``; writing ``5`` to
``/proc/self/clear_refs`` resets it to the current RSS, so each system's peak is measured on its own even
though all systems run in one process. Where that is unavailable the peak is unknown (None), never guessed.
"""

from __future__ import annotations

from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def reset_peak_rss() -> bool:
    """Reset the process's RSS high-water mark; False when the kernel does not allow it."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def _status_kib(key: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def peak_rss_bytes() -> int | None:
    """The RSS high-water mark since the last reset (or process start), in bytes."""
    kib = _status_kib("VmHWM")
    return None if kib is None else kib * 1024


def current_rss_bytes() -> int | None:
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


class PeakRss:
    """``with PeakRss() as meter: ...`` then ``meter.peak_bytes`` (None if the reset is not supported)."""

    def __init__(self) -> None:
        self.peak_bytes: int | None = None
        self._reset = False

    def __enter__(self) -> PeakRss:
        self._reset = reset_peak_rss()
        return self

    def __exit__(self, *exc: object) -> None:
        self.peak_bytes = peak_rss_bytes() if self._reset else None
