"""What this CPU is: its model name and the instruction-set features the CPU path cares about.

Why: the fastest GEMM backend per row count differs between CPUs (an AVX2 EPYC and an AVX-512 Xeon chose
differently, docs/performance.md), so the measured choice is cached per CPU
(:mod:`pagedgen.ops.matmul.gemm_tune`) and the features are printed beside every benchmark. Read from
``/proc/cpuinfo`` (Linux); elsewhere the model is ``platform.processor()`` and the feature set is empty.
"""

from __future__ import annotations

import platform
from functools import cache
from pathlib import Path

# The flags (as /proc/cpuinfo spells them) that decide which kernel variants and library code paths run.
RELEVANT_FEATURES = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "neon",
    "asimd",
    "sve",
)


@cache
def _cpuinfo() -> tuple[str, tuple[str, ...]]:
    """(model name, every flag) of the first CPU listed."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine(), ()
    model, flags = "", ()
    for line in lines:
        name, _, value = (part.strip() for part in line.partition(":"))
        if name == "model name" and not model:
            model = value
        elif name in ("flags", "Features") and not flags:  # x86 spells them flags, Arm Features
            flags = tuple(value.split())
    return model or platform.processor() or platform.machine(), flags


def cpu_model() -> str:
    """e.g. ``Intel(R) Xeon(R) Processor`` or ``AMD EPYC 7B13``."""
    return _cpuinfo()[0]


def cpu_flags() -> tuple[str, ...]:
    """Every feature flag of the CPU (the cache key of measured choices uses all of them)."""
    return _cpuinfo()[1]


def cpu_features() -> tuple[str, ...]:
    """The :data:`RELEVANT_FEATURES` this CPU has, in that order, e.g. ``('avx2', 'fma', 'avx512f')``."""
    flags = set(cpu_flags())
    return tuple(f for f in RELEVANT_FEATURES if f in flags)
