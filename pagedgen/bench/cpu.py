"""The CPU's feature flags that decide which kernels a system can use (AVX2/FMA, AVX-512, VNNI, AMX).

A throughput ratio between two systems means little without them: one peer may have int8 or bf16 kernels
for instructions this CPU lacks. The flags are :func:`pagedgen.ops.kernels.cpu_info.cpu_flags` (one reader of
``/proc/cpuinfo`` for the whole package); empty where it does not exist.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache

from pagedgen.ops.kernels import cpu_info

RELEVANT = (
    "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
    "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni",
)  # fmt: skip


def relevant_flags(flags: Iterable[str]) -> list[str]:
    """The relevant ones of ``flags``, in :data:`RELEVANT`'s order, then any ``amx_*``."""
    present = set(flags)
    return [f for f in RELEVANT if f in present] + sorted(f for f in present if f.startswith("amx_"))


@cache
def cpu_flags() -> tuple[str, ...]:
    return tuple(relevant_flags(cpu_info.cpu_flags()))
