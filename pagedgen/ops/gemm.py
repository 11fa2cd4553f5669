"""GEMM backends for the model's linear layers and the table that picks one per shape.

Why two backends: on the 2-core AMD EPYC (AVX2) CPUs we serve from, torch's MKL sgemm is far slower than
numpy's OpenBLAS at decode-sized batches (1-64 rows), e.g. 576->1536 at 1 row 22 vs 35 GFLOP/s, 1536->576
17 vs 46 (docs/performance.md has the full measured table and the method). From a few hundred rows up both
reach the same compute roof. numpy's matmul on zero-copy views (``Tensor.numpy()`` / ``torch.from_numpy``)
reaches OpenBLAS without copying weights or activations, so the choice costs one Python branch per call.

The table is chosen per ``(rows, in_features, out_features)``: a list of row buckets, each naming a backend,
with optional per-``(in, out)`` overrides. :data:`DEFAULT_TABLE` is the measured one; ``pagedgen bench gemm``
re-measures on the current machine and prints a table to use instead (:func:`use_gemm_table`).
Both backends compute the same fp32 product; only the summation order differs (relative error ~1e-6).
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagedgen.ops.gemm_threads import torch_pool
from pagedgen.ops.native import gemm_kernel


class GemmBackend(enum.Enum):
    TORCH = "torch"  # F.linear: MKL sgemm / oneDNN, torch's OpenMP pool
    OPENBLAS = "openblas"  # numpy.matmul on zero-copy views: numpy's bundled OpenBLAS, its own thread pool
    NATIVE = "native"  # pagedgen's small-batch C kernel (ops/native.py) on torch's OpenMP pool


@dataclass(frozen=True, slots=True)
class RowBucket:
    """Shapes with ``rows <= max_rows`` (and above the previous bucket) use ``backend``."""

    max_rows: int
    backend: GemmBackend

    def __post_init__(self) -> None:
        if isinstance(self.max_rows, bool) or not isinstance(self.max_rows, int) or self.max_rows <= 0:
            raise ValueError(f"RowBucket.max_rows must be a positive int, got {self.max_rows!r}")
        if not isinstance(self.backend, GemmBackend):
            raise ValueError(f"RowBucket.backend must be a GemmBackend, got {self.backend!r}")


@dataclass(frozen=True, slots=True)
class ShapeOverride:
    """Own row buckets for one weight shape whose crossover differs from the rest."""

    in_features: int
    out_features: int
    buckets: tuple[RowBucket, ...]

    def __post_init__(self) -> None:
        _check_ascending(f"ShapeOverride({self.in_features}->{self.out_features}).buckets", self.buckets)


@dataclass(frozen=True, slots=True)
class GemmTable:
    """Backend per row count: ``buckets`` ascending by ``max_rows``; rows above the last use ``default``.

    ``overrides`` give one ``(in_features, out_features)`` its own buckets. Raises ``ValueError`` naming the
    field when buckets are not strictly ascending or a shape is overridden twice.
    """

    buckets: tuple[RowBucket, ...] = ()
    default: GemmBackend = GemmBackend.TORCH
    overrides: tuple[ShapeOverride, ...] = ()

    def __post_init__(self) -> None:
        _check_ascending("GemmTable.buckets", self.buckets)
        if not isinstance(self.default, GemmBackend):
            raise ValueError(f"GemmTable.default must be a GemmBackend, got {self.default!r}")
        shapes = [(o.in_features, o.out_features) for o in self.overrides]
        if len(set(shapes)) != len(shapes):
            raise ValueError(f"GemmTable.overrides names a shape twice: {shapes}")

    def select(self, rows: int, in_features: int, out_features: int) -> GemmBackend:
        """The backend for ``[rows, in] @ [in, out]``."""
        buckets = self.buckets
        for override in self.overrides:
            if override.in_features == in_features and override.out_features == out_features:
                buckets = override.buckets
        for bucket in buckets:
            if rows <= bucket.max_rows:
                return bucket.backend
        return self.default

    def describe(self) -> str:
        """One line, e.g. ``rows<=64: openblas; else torch``."""
        text = "; ".join([*(f"rows<={b.max_rows}: {b.backend.value}" for b in self.buckets), "else "])
        text += self.default.value
        for o in self.overrides:
            inner = ", ".join(f"<={b.max_rows}: {b.backend.value}" for b in o.buckets)
            text += f"; {o.in_features}->{o.out_features}: [{inner}, else {self.default.value}]"
        return text


def _check_ascending(name: str, buckets: tuple[RowBucket, ...]) -> None:
    limits = [b.max_rows for b in buckets]
    if limits != sorted(set(limits)):
        raise ValueError(f"{name} must be strictly ascending by max_rows, got {limits}")


# Measured on the 2-core AMD EPYC dev machine (docs/performance.md): with DRAM-resident weights OpenBLAS on
# 2 threads streams decode-sized GEMMs up to 1.9x faster than MKL (which does not thread them), and a whole
# decode step of 1-16 rows ran 1.2-1.6x faster than on torch. pagedgen's own kernel (a 3 x 4 AVX2 register
# tile on torch's pool) then beat both on whole decode forwards: 1.0x OpenBLAS at 1 row, 1.4-2x at 2-8,
# 1.2-1.3x torch at 32-48 rows, 1.1x at 64, while torch won from 128 rows (prefill). Without a C compiler
# NATIVE falls back to OPENBLAS (see choose_backend), whose own crossover with torch was 16 rows.
NATIVE_MAX_ROWS = 64
OPENBLAS_MAX_ROWS = 16
DEFAULT_TABLE = GemmTable(
    buckets=(RowBucket(NATIVE_MAX_ROWS, GemmBackend.NATIVE),), default=GemmBackend.TORCH
)
OPENBLAS_SMALL = GemmTable(
    buckets=(RowBucket(OPENBLAS_MAX_ROWS, GemmBackend.OPENBLAS),), default=GemmBackend.TORCH
)
TORCH_ONLY = GemmTable(default=GemmBackend.TORCH)
OPENBLAS_ONLY = GemmTable(default=GemmBackend.OPENBLAS)

_active: list[GemmTable] = [DEFAULT_TABLE]
_choices: dict[tuple[int, int | None, int, int], GemmBackend] = {}  # (rows, step rows, in, out) -> backend
_step_rows: list[int | None] = [None]  # the enclosing gemm_step's token count, if any


def active_table() -> GemmTable:
    return _active[0]


def choose_backend(rows: int, in_features: int, out_features: int) -> GemmBackend:
    """The active table's backend for one call, memoised (one dict lookup per linear call).

    Inside :func:`gemm_step`, when the call's own backend and the step's would run on different thread
    pools (one of them OpenBLAS), the step's wins, so no pool hand-over happens mid-step (see
    :func:`gemm_step`). Torch and the native kernel share torch's pool, so a prefill step's LM head over
    its few sampled rows still gets the native kernel.
    """
    key = (rows, _step_rows[0], in_features, out_features)
    backend = _choices.get(key)
    if backend is None:
        backend = _choices[key] = _decide(rows, _step_rows[0], in_features, out_features)
    return backend


def _decide(rows: int, step_rows: int | None, in_features: int, out_features: int) -> GemmBackend:
    call = _select(rows, in_features, out_features)
    if step_rows is None:
        return call
    step = _select(step_rows, in_features, out_features)
    if call is not step and GemmBackend.OPENBLAS in (call, step):
        return step
    return call


def _select(rows: int, in_features: int, out_features: int) -> GemmBackend:
    backend = _active[0].select(rows, in_features, out_features)
    if backend is GemmBackend.NATIVE and gemm_kernel() is None:
        # No compiler here: the previous best choice for the shape (OpenBLAS up to its crossover).
        backend = OPENBLAS_SMALL.select(rows, in_features, out_features)
    return backend


@contextlib.contextmanager
def gemm_step(num_tokens: int) -> Iterator[None]:
    """Tell :func:`choose_backend` the step's ``num_tokens`` for every linear call inside the block.

    Why: switching between the torch and OpenBLAS pools costs a spin-wait hand-over (:mod:`gemm_threads`); a
    prefill step whose layers ran on torch and whose LM head (1 row) then switched to OpenBLAS measured 5-8%
    slower. So a call whose own backend and the step's sit on different pools takes the step's; torch and
    the native kernel share one pool and keep their own choice. Nested scopes restore the outer count.
    """
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens <= 0:
        raise ValueError(f"gemm_step num_tokens must be a positive int, got {num_tokens!r}")
    outer, _step_rows[0] = _step_rows[0], num_tokens
    try:
        yield
    finally:
        _step_rows[0] = outer


def set_gemm_table(table: GemmTable) -> GemmTable:
    """Make ``table`` the process-wide choice; returns the previous one. Not for use mid-forward."""
    if not isinstance(table, GemmTable):
        raise ValueError(f"set_gemm_table takes a GemmTable, got {type(table).__name__}")
    previous, _active[0] = _active[0], table
    _choices.clear()
    return previous


@contextlib.contextmanager
def use_gemm_table(table: GemmTable) -> Iterator[GemmTable]:
    """Use ``table`` inside the block (benchmarks compare backends in one process), then restore."""
    previous = set_gemm_table(table)
    try:
        yield table
    finally:
        set_gemm_table(previous)


def torch_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` with torch's pool at its full thread count (restored if OpenBLAS had parked it)."""
    torch_pool.restore()
    return F.linear(x, weight, bias)


def native_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The native small-batch kernel on torch's pool at its full thread count (:mod:`pagedgen.ops.native`)."""
    torch_pool.restore()
    kernel = gemm_kernel()
    if kernel is None:
        return openblas_gemm(x, weight, bias)
    return kernel(x, weight, bias)


def openblas_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [rows, in] @ weight[out, in].T (+ bias)`` by numpy/OpenBLAS; no copy of ``x`` or ``weight``.

    ``weight.numpy().T`` is a Fortran-ordered view that numpy hands to sgemm as a transposed operand. The
    result is a fresh ``[rows, out]`` array, returned as a tensor sharing its memory.
    """
    torch_pool.park()
    out = np.matmul(x.numpy(), weight.numpy().T)  # [rows, out]
    if bias is not None:
        np.add(out, bias.numpy(), out=out)
    return torch.from_numpy(out)


def openblas_eligible(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """OpenBLAS can take the call: CPU fp32, 2-D, no autograd, strides numpy can read without a copy."""
    return (
        x.dtype is torch.float32
        and weight.dtype is torch.float32
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.dim() == 2
        and weight.dim() == 2
        and x.stride(1) == 1
        and weight.is_contiguous()
        and not (x.requires_grad or weight.requires_grad)
        and (bias is None or (bias.dtype is torch.float32 and not bias.requires_grad))
    )
