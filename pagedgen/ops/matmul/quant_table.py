"""Which path a linear call over a weight kept in its stored format takes, per weight kind and row count.

Why a table: :mod:`pagedgen.ops.matmul.quant_gemm` has two paths, the native kernel that streams the packed
blocks (bandwidth-bound, best at few rows) and dequantise + torch's GEMM (compute-bound, best at many rows),
and where one overtakes the other depends on the CPU, the thread count, the format and the shape. So the
crossover is measured per machine and model with the GEMM calibration
(:mod:`pagedgen.ops.matmul.quant_calibrate`, cached by :mod:`pagedgen.ops.matmul.gemm_tune`) and installed
here at engine start. docs/performance.md, "Module notes: ops and bench", has the rest.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from dataclasses import dataclass

from pagedgen.ops.matmul.qweight import QType

# The uncalibrated fallback, measured once on a 2-core AVX-512 Xeon, one thread, the default model's Q4_1
# shapes with hot caches: the kernel won up to 96 rows, tied at 128, lost at 256 (docs/performance.md).
UNCALIBRATED_KERNEL_MAX_ROWS = 96


class QuantPath(enum.Enum):
    """In preference order for equal times: the kernel first (no fp32 copy of the weight is made)."""

    KERNEL = "kernel"  # quant_gemm: the native kernel over the packed blocks
    DEQUANT = "dequant"  # tiled_dequant_gemm: dequantise to fp32, then torch's GEMM


@dataclass(frozen=True, slots=True)
class QuantBucket:
    """Calls with ``rows <= max_rows`` (and above the previous bucket) take ``path``."""

    max_rows: int
    path: QuantPath

    def __post_init__(self) -> None:
        if isinstance(self.max_rows, bool) or not isinstance(self.max_rows, int) or self.max_rows <= 0:
            raise ValueError(f"QuantBucket.max_rows must be a positive int, got {self.max_rows!r}")
        if not isinstance(self.path, QuantPath):
            raise ValueError(f"QuantBucket.path must be a QuantPath, got {self.path!r}")


def kind_name(qtype: QType, shape: tuple[int, int]) -> str:
    """``Q4_1 576->960`` for a ``(out, in) = (960, 576)`` weight: format, then in -> out as GemmTable does."""
    return f"{qtype.name} {shape[1]}->{shape[0]}"


@dataclass(frozen=True, slots=True)
class QuantOverride:
    """Own row buckets and default (rows above the last bucket) for one kind."""

    qtype: QType
    shape: tuple[int, int]  # (out_features, in_features), as QuantizedWeight.shape
    buckets: tuple[QuantBucket, ...]
    default: QuantPath

    def __post_init__(self) -> None:
        name = f"QuantOverride({kind_name(self.qtype, self.shape)})"
        _check_ascending(f"{name}.buckets", self.buckets)
        if not isinstance(self.default, QuantPath):
            raise ValueError(f"{name}.default must be a QuantPath, got {self.default!r}")


@dataclass(frozen=True, slots=True)
class QuantTable:
    """Path per row count: ``buckets`` ascending by ``max_rows``, ``default`` above; ``overrides`` per kind.

    Raises ``ValueError`` naming the field when buckets are not strictly ascending or a kind is overridden
    twice.
    """

    buckets: tuple[QuantBucket, ...] = ()
    default: QuantPath = QuantPath.DEQUANT
    overrides: tuple[QuantOverride, ...] = ()

    def __post_init__(self) -> None:
        _check_ascending("QuantTable.buckets", self.buckets)
        if not isinstance(self.default, QuantPath):
            raise ValueError(f"QuantTable.default must be a QuantPath, got {self.default!r}")
        kinds = [kind_name(o.qtype, o.shape) for o in self.overrides]
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"QuantTable.overrides names a kind twice: {kinds}")

    def select(self, qtype: QType, shape: tuple[int, int], rows: int) -> QuantPath:
        buckets, default = self.buckets, self.default
        for override in self.overrides:
            if override.qtype is qtype and override.shape == shape:
                buckets, default = override.buckets, override.default
        for bucket in buckets:
            if rows <= bucket.max_rows:
                return bucket.path
        return default

    def describe(self) -> str:
        """One line, e.g. ``rows<=32: kernel; else dequant; Q8_0 576->49152: [<=8: kernel, else dequant]``."""
        text = _describe(self.buckets, self.default, "rows", "; ")
        for o in self.overrides:
            text += f"; {kind_name(o.qtype, o.shape)}: [{_describe(o.buckets, o.default, '', ', ')}]"
        return text


def _describe(buckets: tuple[QuantBucket, ...], default: QuantPath, prefix: str, separator: str) -> str:
    parts = [*(f"{prefix}<={b.max_rows}: {b.path.value}" for b in buckets), f"else {default.value}"]
    return separator.join(parts)


def _check_ascending(name: str, buckets: tuple[QuantBucket, ...]) -> None:
    limits = [b.max_rows for b in buckets]
    if limits != sorted(set(limits)):
        raise ValueError(f"{name} must be strictly ascending by max_rows, got {limits}")


UNCALIBRATED = QuantTable(buckets=(QuantBucket(UNCALIBRATED_KERNEL_MAX_ROWS, QuantPath.KERNEL),))
KERNEL_ONLY = QuantTable(default=QuantPath.KERNEL)
DEQUANT_ONLY = QuantTable(default=QuantPath.DEQUANT)

_active: list[QuantTable] = [UNCALIBRATED]
_pinned: list[bool] = [False]
_choices: dict[tuple[QType, tuple[int, int], int], QuantPath] = {}  # (qtype, shape, rows) -> path


def active_quant_table() -> QuantTable:
    return _active[0]


def quant_path(qtype: QType, shape: tuple[int, int], rows: int) -> QuantPath:
    """The active table's path for one call, memoised (one dict lookup per call)."""
    key = (qtype, shape, rows)
    path = _choices.get(key)
    if path is None:
        path = _choices[key] = _active[0].select(qtype, shape, rows)
    return path


def set_quant_table(table: QuantTable, *, pinned: bool = True) -> QuantTable:
    """Make ``table`` the process-wide choice; returns the previous one. Not for use mid-forward.

    ``pinned`` (the default) keeps it over the table the engine measures at start (:func:`adopt_quant_table`).
    """
    if not isinstance(table, QuantTable):
        raise ValueError(f"set_quant_table takes a QuantTable, got {type(table).__name__}")
    previous, _active[0], _pinned[0] = _active[0], table, pinned
    _choices.clear()
    return previous


def adopt_quant_table(table: QuantTable) -> bool:
    """Install a measured ``table`` unless one was pinned by :func:`set_quant_table`; True if installed."""
    if _pinned[0]:
        return False
    set_quant_table(table, pinned=False)
    return True


def quant_table_pinned() -> bool:
    return _pinned[0]


@contextlib.contextmanager
def use_quant_table(table: QuantTable) -> Iterator[QuantTable]:
    """Use ``table`` (pinned) inside the block, then restore the previous table and whether it was pinned."""
    was_pinned = _pinned[0]
    previous = set_quant_table(table)
    try:
        yield table
    finally:
        set_quant_table(previous, pinned=was_pinned)
