"""Keep freed CPU buffers in the process instead of handing them back to the OS after every op.

A model step allocates multi-megabyte temporaries (paged attention's gathered K/V, prefill activations) and
frees them a moment later. With glibc's default dynamic thresholds such a buffer is either mmapped or, once
freed, trimmed off the heap top, so the next step page-faults and zeroes the same memory again: on a
16-request decode this doubled paged attention's time (about 2,500 minor faults per layer call). Raising
the mmap and trim thresholds once per process lets glibc reuse the memory. glibc caps the mmap threshold
at 32 MiB, so a buffer of that size or more was still mapped afresh on every call: the logits of a decode
step of 32 rows over Gemma 3's 262,144-token vocabulary are exactly 32 MiB, and allocating and writing them
took 7.3 ms against 0.6 ms for 31 rows from the heap (about 5% of that step). So mmap is turned off for the
allocator altogether (``M_MMAP_MAX`` 0): every buffer comes from the heap and is reused (1.2 ms for the same
32 MiB). The KV cache (its own anonymous mapping, ``core/kv.py``) and weights kept as stored (mappings of
their cache file) do not go through malloc; weights dequantised at load do, and live as long as the
process anyway. The cost: resident memory stays at its high-water mark, which an inference server reaches
anyway.

This is process-global, so the executor (not a library op) decides to call it, once, for CPU execution.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's upper bound for this setting on 64-bit
TRIM_THRESHOLD_BYTES = 1 << 30


def _glibc_function(name: str) -> Callable[..., int] | None:
    """``name`` of the process's C library when it is glibc-like (Linux, the function exported), else None."""
    if not sys.platform.startswith("linux"):
        return None
    library = ctypes.util.find_library("c")
    if library is None:
        return None
    try:
        return getattr(ctypes.CDLL(library), name)
    except (OSError, AttributeError):  # not glibc (e.g. musl has no mallopt)
        return None


def retain_freed_cpu_memory() -> bool:
    """Raise glibc's mmap/trim thresholds and stop it mapping large buffers; returns ``True`` if glibc
    accepted every setting, ``False`` elsewhere.

    Mutates process-wide allocator settings (idempotent). Never raises: an unknown C library simply leaves
    the defaults.
    """
    mallopt = _glibc_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    mmap_ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    trim_ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    no_maps_ok = mallopt(_M_MMAP_MAX, 0) == 1
    return mmap_ok and trim_ok and no_maps_ok


def release_freed_cpu_memory() -> bool:
    """Hand the heap's free pages back to the OS once (glibc's ``malloc_trim``); ``True`` if it ran.

    For the end of a one-off phase whose temporaries a running engine never needs again: the engine's
    start-up measurement of the GEMM paths (``pagedgen.ops.matmul.gemm_tune``) multiplies at prefill sizes,
    and with the settings above its freed buffers would stay resident for the process's life (about 200 MiB
    on the default model's first start). Never raises.
    """
    trim = _glibc_function("malloc_trim")
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
    return True
