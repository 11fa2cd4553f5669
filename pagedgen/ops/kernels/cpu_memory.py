"""Keep freed CPU buffers in the process instead of handing them back to the OS after every op.

A model step allocates multi-megabyte temporaries (paged attention's gathered K/V, prefill activations) and
frees them a moment later. With glibc's default dynamic thresholds such a buffer is either mmapped or, once
freed, trimmed off the heap top, so the next step page-faults and zeroes the same memory again: on a
16-request decode this doubled paged attention's time (about 2,500 minor faults per layer call). Raising
the mmap and trim thresholds once per process lets glibc reuse the memory. The cost: resident memory stays
at its high-water mark, which an inference server reaches anyway.

This is process-global, so the executor (not a library op) decides to call it, once, for CPU execution.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's upper bound for this setting on 64-bit
TRIM_THRESHOLD_BYTES = 1 << 30


def retain_freed_cpu_memory() -> bool:
    """Raise glibc's mmap/trim thresholds; returns ``True`` if glibc accepted both, ``False`` elsewhere.

    Mutates process-wide allocator settings (idempotent). Buffers above 32 MiB (weights, the KV cache) are
    still mmapped individually. Never raises: an unknown C library simply leaves the defaults.
    """
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    mmap_ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    trim_ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    return mmap_ok and trim_ok
