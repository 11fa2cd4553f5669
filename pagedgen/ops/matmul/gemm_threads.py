"""Thread counts of the two GEMM thread pools: torch's OpenMP pool and numpy's OpenBLAS pool.

Why both: the linear layers run on OpenBLAS at decode sizes and on torch (MKL / oneDNN, OpenMP) elsewhere
(:mod:`pagedgen.ops.matmul.gemm`), and attention, norms and activations always run on torch. Each pool must
use every core this process may run on, and no more: an oversubscribed pool on a 2-core machine waits on a
preempted worker at every barrier. numpy has no API for its BLAS thread count, so it is set through the
OpenBLAS library numpy already loaded (``dlopen`` of a loaded path returns that same library).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

# Symbol prefixes of OpenBLAS builds: numpy's scipy-openblas (64-bit ints), plain OpenBLAS, the 64_ suffix.
_SET_NAMES = ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_", "openblas_set_num_threads")
_GET_NAMES = ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_", "openblas_get_num_threads")
_CORE_NAMES = ("scipy_openblas_get_corename64_", "openblas_get_corename64_", "openblas_get_corename")


@dataclass(frozen=True, slots=True)
class ThreadSettings:
    """The process's thread counts; ``blas_*`` are None when numpy's BLAS is not OpenBLAS."""

    cpus: int
    torch_threads: int
    blas_threads: int | None
    blas_library: str | None
    blas_core: str | None


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@cache
def _openblas_path() -> str | None:
    """Path of the OpenBLAS shared library numpy has loaded, if any (read from ``/proc/self/maps``)."""
    _ = np.ones(2) @ np.ones(2)  # make sure numpy's BLAS is loaded
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.rsplit(maxsplit=1)[-1]
                name = os.path.basename(path).lower()
                if "openblas" in name and (".so" in name or name.endswith(".dylib")):
                    return path
    except OSError:
        return None
    return None


def _symbol(names: tuple[str, ...]) -> ctypes._CFuncPtr | None:
    path = _openblas_path()
    if path is None:
        return None
    library = ctypes.CDLL(path)
    for name in names:
        fn = getattr(library, name, None)
        if fn is not None:
            return fn
    return None


def blas_num_threads() -> int | None:
    fn = _symbol(_GET_NAMES)
    if fn is None:
        return None
    fn.restype = ctypes.c_int
    return int(fn())


def blas_core() -> str | None:
    """OpenBLAS's kernel family for this CPU (e.g. ``Haswell``); None when unknown."""
    fn = _symbol(_CORE_NAMES)
    if fn is None:
        return None
    fn.restype = ctypes.c_char_p
    name = fn()
    return name.decode() if name else None


def set_blas_num_threads(threads: int) -> bool:
    """Set numpy's OpenBLAS thread count; False (nothing changed) when numpy's BLAS is not OpenBLAS."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads <= 0:
        raise ValueError(f"threads must be a positive int, got {threads!r}")
    fn = _symbol(_SET_NAMES)
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_int]
    fn.restype = None
    fn(threads)
    return True


class _TorchPool:
    """Parks torch's OpenMP pool at one thread while OpenBLAS GEMMs run, and restores it for torch GEMMs.

    Why: both pools spin-wait after a call. On 2 cores, an OpenBLAS call made while torch's OpenMP worker
    still spins (and vice versa) waits for that spin to end or for a scheduler tick: a whole decode step
    measured 4-5x slower with both pools at 2 threads than with either alone (docs/performance.md). So only
    one pool is multi-threaded at a time: steps whose linear layers run on OpenBLAS run torch's own ops
    (attention, norms, activations) on one thread; steps whose linear layers run on torch get every thread.
    """

    def __init__(self) -> None:
        self.full_threads = torch.get_num_threads()
        self.parked = False

    def park(self) -> None:
        if not self.parked:
            torch.set_num_threads(1)
            self.parked = True

    def restore(self) -> None:
        if self.parked:
            torch.set_num_threads(self.full_threads)
            self.parked = False

    def set_full(self, threads: int) -> None:
        self.full_threads = threads
        torch.set_num_threads(1 if self.parked else threads)


torch_pool = _TorchPool()


def configure_cpu_threads(threads: int | None = None) -> ThreadSettings:
    """Give both GEMM pools ``threads`` workers (default: every usable CPU); returns what is in effect.

    Mutates process-wide state (``torch.set_num_threads`` and OpenBLAS's pool). Raises ``ValueError`` for a
    non-positive count.
    """
    threads = usable_cpus() if threads is None else threads
    if isinstance(threads, bool) or not isinstance(threads, int) or threads <= 0:
        raise ValueError(f"threads must be a positive int, got {threads!r}")
    torch_pool.set_full(threads)
    set_blas_num_threads(threads)
    return current_thread_settings()


def current_thread_settings() -> ThreadSettings:
    """The thread counts in effect (``torch_threads`` is the full count, also while parked)."""
    return ThreadSettings(
        cpus=usable_cpus(),
        torch_threads=torch_pool.full_threads,
        blas_threads=blas_num_threads(),
        blas_library=_openblas_path(),
        blas_core=blas_core(),
    )
