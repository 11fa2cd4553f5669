"""GEMM backends for the model's linear layers and the table that picks one per shape.

Why several backends: which library is fastest at decode-sized batches (1-64 rows) depends on the CPU. On a
2-core AMD EPYC (AVX2) numpy's OpenBLAS beat torch's MKL up to 1.9x and pagedgen's own kernel beat both; on an
AVX-512 Xeon the order was different again (docs/performance.md). So no threshold is fixed here: at engine
start the candidates are timed on the model's own linear layers and the fastest per row count becomes the
active table (:mod:`pagedgen.ops.matmul.gemm_tune`, cached per machine). numpy's matmul on zero-copy views
(``Tensor.numpy()`` / ``torch.from_numpy``) reaches OpenBLAS without copying weights or activations, so the
choice costs one Python branch per call. docs/performance.md, "Module notes: ops and bench", has the rest.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagedgen.ops.kernels.native import gemm_kernel
from pagedgen.ops.matmul.gemm_threads import torch_pool


class GemmBackend(enum.Enum):
    TORCH = "torch"  # F.linear: MKL sgemm / oneDNN, torch's OpenMP pool
    OPENBLAS = "openblas"  # numpy.matmul on zero-copy views: numpy's bundled OpenBLAS, its own thread pool
    NATIVE = "native"  # pagedgen's small-batch C kernel (ops/kernels/native.py) on torch's OpenMP pool


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


TORCH_ONLY = GemmTable(default=GemmBackend.TORCH)
OPENBLAS_ONLY = GemmTable(default=GemmBackend.OPENBLAS)
NATIVE_ONLY = GemmTable(default=GemmBackend.NATIVE)
UNTUNED = TORCH_ONLY  # before any measurement: the library's own GEMM, no machine-specific guess

_active: list[GemmTable] = [UNTUNED]
_pinned: list[bool] = [False]  # set_gemm_table's choice stands over a measured one
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
        # A table naming the native kernel, used where it cannot be built (a measured table never does).
        backend = GemmBackend.TORCH
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


def set_gemm_table(table: GemmTable, *, pinned: bool = True) -> GemmTable:
    """Make ``table`` the process-wide choice; returns the previous one. Not for use mid-forward.

    ``pinned`` (the default) keeps it over the table the engine measures at start (:func:`adopt_table`).
    """
    if not isinstance(table, GemmTable):
        raise ValueError(f"set_gemm_table takes a GemmTable, got {type(table).__name__}")
    previous, _active[0], _pinned[0] = _active[0], table, pinned
    _choices.clear()
    return previous


def adopt_table(table: GemmTable) -> bool:
    """Install a measured ``table`` unless one was pinned by :func:`set_gemm_table`; True if installed."""
    if _pinned[0]:
        return False
    set_gemm_table(table, pinned=False)
    return True


def table_pinned() -> bool:
    return _pinned[0]


@contextlib.contextmanager
def use_gemm_table(table: GemmTable) -> Iterator[GemmTable]:
    """Use ``table`` (pinned) inside the block (benchmarks compare backends in one process), then restore
    the previous table and whether it was pinned."""
    was_pinned = _pinned[0]
    previous = set_gemm_table(table)
    try:
        yield table
    finally:
        set_gemm_table(previous, pinned=was_pinned)


def torch_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` with torch's pool at its full thread count (restored if OpenBLAS had parked it)."""
    torch_pool.restore()
    return F.linear(x, weight, bias)


def native_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The native small-batch kernel on torch's pool at its full thread count
    (:mod:`pagedgen.ops.kernels.native`)."""
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
