"""Measure the GEMM backends per ``(rows, in, out)`` on this machine and derive a :class:`GemmTable`.

Method (docs/performance.md, "how the GEMM table was measured"):

* weights are DRAM-resident, like a real model's: each shape cycles through enough distinct weight matrices
  to exceed the last-level cache (a single reused weight sits in L3 and overstates decode-sized GEMMs);
* each candidate runs a block of calls in its own pool mode (OpenBLAS parks torch's pool, torch restores it),
  blocks of the candidates alternate, and the best block per candidate is kept: on a shared machine the
  least-disturbed block is the closest estimate of what the hardware does;
* ratios are taken within one process and one trial loop, never across runs.

:func:`derive_table` then picks, per row count, the backend with the smaller summed time over all of a
model's shapes (one backend per step, see :func:`pagedgen.ops.gemm.gemm_step`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedgen.ops.gemm import GemmBackend, GemmTable, RowBucket, native_gemm, openblas_gemm, torch_gemm
from pagedgen.ops.native import gemm_kernel

DRAM_BYTES = 192 << 20  # enough distinct weights per shape to stream from memory, not cache

Gemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def available_backends() -> dict[GemmBackend, Gemm]:
    """The backends this machine can run (NATIVE needs the compiled kernels)."""
    gemms: dict[GemmBackend, Gemm] = {GemmBackend.TORCH: torch_gemm, GemmBackend.OPENBLAS: openblas_gemm}
    if gemm_kernel() is not None:
        gemms[GemmBackend.NATIVE] = native_gemm
    return gemms


@dataclass(frozen=True, slots=True)
class ShapeTiming:
    """Best seconds per call of each backend for ``[rows, in] @ [in, out]``."""

    rows: int
    in_features: int
    out_features: int
    seconds: dict[GemmBackend, float]

    @property
    def flops(self) -> float:
        return 2.0 * self.rows * self.in_features * self.out_features

    def gflops(self, backend: GemmBackend) -> float:
        return self.flops / self.seconds[backend] / 1e9

    def ratio(self, backend: GemmBackend, over: GemmBackend = GemmBackend.TORCH) -> float:
        """How many times faster ``backend`` is than ``over`` (> 1: faster)."""
        return self.seconds[over] / self.seconds[backend]

    @property
    def fastest(self) -> GemmBackend:
        return min(self.seconds, key=self.seconds.__getitem__)


def model_linear_shapes(config: object) -> list[tuple[int, int]]:
    """Distinct ``(in, out)`` of a Llama-family model's linear layers, the LM head last."""
    hidden, d = config.hidden_size, config.head_dim  # type: ignore[attr-defined]
    q, kv = config.num_heads * d, config.num_kv_heads * d  # type: ignore[attr-defined]
    inner = config.intermediate_size  # type: ignore[attr-defined]
    shapes = [(hidden, q), (hidden, kv), (q, hidden), (hidden, inner), (inner, hidden)]
    shapes.append((hidden, config.vocab_size))  # type: ignore[attr-defined]
    return list(dict.fromkeys(shapes))


def _block(gemm: Gemm, x: torch.Tensor, weights: Sequence[torch.Tensor]) -> float:
    start = time.perf_counter()
    for w in weights:
        gemm(x, w, None)
    return (time.perf_counter() - start) / len(weights)


def time_shape(
    rows: int, in_features: int, out_features: int, trials: int = 5, dram_bytes: int = DRAM_BYTES
) -> ShapeTiming:
    """Best-of-``trials`` seconds per call of each backend (method in the module docstring)."""
    count = max(2, dram_bytes // (4 * in_features * out_features))
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(out_features, in_features, generator=gen) for _ in range(count)]
    x = torch.randn(rows, in_features, generator=gen)
    gemms = available_backends()
    best = dict.fromkeys(gemms, float("inf"))
    with torch.inference_mode():
        for _ in range(trials):
            for backend, gemm in gemms.items():
                _block(gemm, x, weights[:2])  # switch pools outside the timed block
                best[backend] = min(best[backend], _block(gemm, x, weights))
    return ShapeTiming(rows, in_features, out_features, best)


def check_equivalence(rows: int, in_features: int, out_features: int) -> float:
    """Max relative difference between torch's output and every other backend's, for one random problem."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows, in_features, generator=gen)
    w = torch.randn(out_features, in_features, generator=gen)
    with torch.inference_mode():
        outs = [gemm(x, w, None) for gemm in available_backends().values()]
    scale = float(np.abs(outs[0].numpy()).max()) or 1.0
    return max(float((outs[0] - other).abs().max()) / scale for other in outs[1:])


def derive_table(timings: Sequence[ShapeTiming]) -> GemmTable:
    """Per row count, the backend with the smaller summed time over all shapes; merged into row buckets."""
    rows = sorted({t.rows for t in timings})
    winner: dict[int, GemmBackend] = {}
    for r in rows:
        total: dict[GemmBackend, float] = {}
        for t in timings:
            if t.rows == r:
                for backend, seconds in t.seconds.items():
                    total[backend] = total.get(backend, 0.0) + seconds
        winner[r] = min(total, key=total.__getitem__)
    buckets: list[RowBucket] = []
    for r in rows:
        if buckets and buckets[-1].backend is winner[r]:
            buckets[-1] = RowBucket(r, winner[r])
        else:
            buckets.append(RowBucket(r, winner[r]))
    default = buckets.pop().backend if buckets else GemmBackend.TORCH
    return GemmTable(buckets=tuple(buckets), default=default)
