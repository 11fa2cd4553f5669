"""The process's CPU thread count while tensor-parallel engines run in it: a counted, process-wide guard.

A tensor-parallel runner on the CPU gives rank 0 ``cpus // T`` threads (more threads than cores across the
ranks makes their spinning pools fight). The thread pools are process-wide, and one process may hold several
engines whose lifetimes overlap in any order (a test keeps a one-rank and a two-rank engine side by side, a
server replaces one engine by another). Saving the count at start and putting it back at release is right
only when engines end in the reverse order they began: the first to end would restore the full count under
a runner still running, the last would restore the first one's setting.

So the guard counts its holders: the first to enter saves the settings in effect, every holder's request
is kept, the smallest request is what runs while any holder remains (each runner asked for at most that
many), and the last to leave restores what the first saw. Holders leave in any order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from pagedgen.ops.matmul.gemm_threads import (
    ThreadSettings,
    configure_cpu_threads,
    current_thread_settings,
    set_blas_num_threads,
    torch_pool,
)


def _restore(settings: ThreadSettings) -> None:
    torch_pool.set_full(settings.torch_threads)
    if settings.blas_threads is not None:
        set_blas_num_threads(settings.blas_threads)


@dataclass(frozen=True, slots=True)
class ThreadHold:
    """One holder's place in a :class:`ThreadGuard` (give it back with ``guard.release``)."""

    ident: int
    threads: int


class ThreadGuard:
    """Process-wide thread count shared by overlapping holders (module docstring).

    ``read`` returns the settings in effect, ``apply`` sets a thread count, ``restore`` puts saved settings
    back; the defaults act on torch's and OpenBLAS's pools (other callables let a test watch the calls).
    """

    def __init__(
        self,
        read: Callable[[], ThreadSettings] = current_thread_settings,
        apply: Callable[[int], object] = configure_cpu_threads,
        restore: Callable[[ThreadSettings], None] = _restore,
    ):
        self._read, self._apply, self._restore = read, apply, restore
        self._lock = threading.Lock()
        self._holds: dict[int, int] = {}
        self._next = 0
        self._saved: ThreadSettings | None = None

    def acquire(self, threads: int) -> ThreadHold:
        """Run with at most ``threads`` threads until ``release``; raises ``ValueError`` for a count < 1."""
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a positive int, got {threads!r}")
        with self._lock:
            if not self._holds:
                self._saved = self._read()
            self._next += 1
            self._holds[self._next] = threads
            self._apply(min(self._holds.values()))
            return ThreadHold(self._next, threads)

    def release(self, hold: ThreadHold) -> None:
        """Give ``hold`` back (a second release of the same hold does nothing): the smallest remaining
        request runs, or, once none remains, the settings the first holder saw."""
        with self._lock:
            if self._holds.pop(hold.ident, None) is None:
                return
            if self._holds:
                self._apply(min(self._holds.values()))
            else:
                saved, self._saved = self._saved, None
                self._restore(saved)

    @property
    def holders(self) -> int:
        return len(self._holds)


cpu_threads = ThreadGuard()  # the process's one guard over torch's and OpenBLAS's pools
