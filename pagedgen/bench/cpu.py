"""The CPU's feature flags that decide which kernels a system can use (AVX2/FMA, AVX-512, VNNI, AMX).

A throughput ratio between two systems means little without them: one peer may have int8 or bf16 kernels
for instructions this CPU lacks. Read from ``/proc/cpuinfo``; empty where it does not exist.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

RELEVANT = (
    "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
    "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni",
)  # fmt: skip


def relevant_flags(cpuinfo: str) -> list[str]:
    """The relevant flags of the first ``flags`` line, in :data:`RELEVANT`'s order, then any ``amx_*``."""
    line = next((x for x in cpuinfo.splitlines() if x.startswith("flags")), "")
    present = set(line.partition(":")[2].split())
    return [f for f in RELEVANT if f in present] + sorted(f for f in present if f.startswith("amx_"))


@cache
def cpu_flags() -> tuple[str, ...]:
    try:
        return tuple(relevant_flags(Path("/proc/cpuinfo").read_text()))
    except OSError:
        return ()
