"""Adapt the GEMM tables to the machine: measure once per machine and model, cache the result, install it.

Why: the fastest backend per row count depends on the CPU, the libraries and the thread count (an AVX2 EPYC
and an AVX-512 Xeon disagree, docs/performance.md), so nothing about it is fixed in code. At engine start
:func:`adapt_to_model` times the fp32 backends and the quantized paths on the model's own weights at the row
counts the engine's steps produce, and caches the result per machine and model. docs/performance.md, "Module
notes: ops and bench", has the rest.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from pagedgen.core.json_value import JsonObject
from pagedgen.core.paths import cache_root
from pagedgen.ops.kernels.cpu_info import cpu_flags, cpu_model
from pagedgen.ops.kernels.native import native_status
from pagedgen.ops.matmul.gemm import (
    NATIVE_ONLY,
    OPENBLAS_ONLY,
    TORCH_ONLY,
    GemmBackend,
    GemmTable,
    adopt_table,
    table_pinned,
)
from pagedgen.ops.matmul.gemm_calibrate import (
    LinearWeight,
    PassTiming,
    RowCounts,
    derive_table,
    engine_row_counts,
    explain_table,
    model_linear_weights,
    time_passes,
)
from pagedgen.ops.matmul.gemm_threads import current_thread_settings, torch_pool
from pagedgen.ops.matmul.quant_calibrate import (
    QuantLinearWeight,
    QuantPassTiming,
    derive_quant_table,
    explain_quant_table,
    model_quant_weights,
    time_quant_passes,
)
from pagedgen.ops.matmul.quant_gemm import quant_kernels
from pagedgen.ops.matmul.quant_table import (
    DEQUANT_ONLY,
    KERNEL_ONLY,
    QuantPath,
    QuantTable,
    adopt_quant_table,
    quant_table_pinned,
)
from pagedgen.ops.matmul.qweight import QType

log = logging.getLogger(__name__)

TABLE_ENV = "PAGEDGEN_GEMM_TABLE"
# Bump when the measurement changes meaning: every cached entry is then re-measured. 2: quantized paths;
# 3: the quantized crossover caps each count's loss (quant_calibrate.MAX_LOSS).
METHOD_VERSION = 3
FIXED_TABLES = {"torch": TORCH_ONLY, "openblas": OPENBLAS_ONLY, "native": NATIVE_ONLY}
# What each fixed name means for weights kept in their stored format (module docstring).
FIXED_QUANT_TABLES = {"torch": DEQUANT_ONLY, "openblas": DEQUANT_ONLY, "native": KERNEL_ONLY}

Measure = Callable[[Sequence[LinearWeight], RowCounts], list[PassTiming]]
QuantMeasure = Callable[[Sequence[QuantLinearWeight], RowCounts], list[QuantPassTiming]]


@dataclass(frozen=True, slots=True)
class Calibration:
    """The tables and where they came from: measured timings (with the key they were measured under) or a
    fixed choice. ``source`` says which: ``measured``, ``cache <path>``, ``PAGEDGEN_GEMM_TABLE=...``.

    ``table`` is None when no fp32 linear weight was measured (a model on native weights), ``quant`` when no
    quantized one was (a model on float32 weights).
    """

    table: GemmTable | None
    reasons: tuple[str, ...]
    source: str
    key: JsonObject | None = None
    timings: tuple[PassTiming, ...] = ()
    quant: QuantTable | None = None
    quant_reasons: tuple[str, ...] = ()
    quant_timings: tuple[QuantPassTiming, ...] = ()

    @classmethod
    def from_timings(
        cls,
        timings: Sequence[PassTiming],
        source: str,
        key: JsonObject | None,
        quant_timings: Sequence[QuantPassTiming] = (),
    ) -> Calibration:
        return cls(
            derive_table(timings) if timings else None,
            tuple(explain_table(timings)),
            source,
            key,
            tuple(timings),
            derive_quant_table(quant_timings) if quant_timings else None,
            tuple(explain_quant_table(quant_timings)),
            tuple(quant_timings),
        )

    def to_json(self) -> JsonObject:
        return {
            "key": self.key,
            "table": None if self.table is None else self.table.describe(),
            "reasons": list(self.reasons),
            "timings": [
                {"rows": t.rows, "flops": t.flops, "seconds": {b.value: s for b, s in t.seconds.items()}}
                for t in self.timings
            ],
            "quant_table": None if self.quant is None else self.quant.describe(),
            "quant_reasons": list(self.quant_reasons),
            "quant_timings": [
                {"rows": t.rows, "qtype": t.qtype.name, "shape": list(t.shape), "flops": t.flops}
                | {"seconds": {p.value: s for p, s in t.seconds.items()}}
                for t in self.quant_timings
            ],
        }


def timings_from_json(document: JsonObject) -> tuple[tuple[PassTiming, ...], tuple[QuantPassTiming, ...]]:
    """The fp32 and quantized timings of a cache entry (an entry from before the quantized paths has none of
    the latter); raises ``KeyError``/``ValueError``/``TypeError`` when malformed or empty."""
    timings = tuple(
        PassTiming(
            int(t["rows"]),
            float(t["flops"]),
            {GemmBackend(name): float(s) for name, s in t["seconds"].items()},
        )
        for t in document["timings"]
    )
    quant_timings = tuple(
        QuantPassTiming(
            int(t["rows"]),
            QType[t["qtype"]],
            (int(t["shape"][0]), int(t["shape"][1])),
            float(t["flops"]),
            {QuantPath(name): float(s) for name, s in t["seconds"].items()},
        )
        for t in document.get("quant_timings", ())
    )
    measured = [*timings, *quant_timings]
    if not measured or any(not t.seconds or min(t.seconds.values()) <= 0 for t in measured):
        raise ValueError("a calibration entry needs positive timings")
    return timings, quant_timings


def calibration_key(
    weights: Sequence[LinearWeight], counts: RowCounts, quant_weights: Sequence[QuantLinearWeight] = ()
) -> JsonObject:
    """Everything a measured choice depends on (see the module docstring); JSON-serialisable."""
    threads = current_thread_settings()
    native = native_status()
    shapes: dict[str, int] = {}
    for w in weights:
        name = f"{w.shape[0]}x{w.shape[1]}{'' if w.every_token else ' head'}"
        shapes[name] = shapes.get(name, 0) + 1
    quant_shapes: dict[str, int] = {}
    for q in quant_weights:
        quant_shapes[q.name] = quant_shapes.get(q.name, 0) + 1
    return {
        "method": METHOD_VERSION,
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "cpu_flags": " ".join(cpu_flags()),
        "torch_threads": threads.torch_threads,
        "blas_threads": threads.blas_threads,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "blas": [Path(threads.blas_library).name if threads.blas_library else None, threads.blas_core],
        "native": Path(native.detail).name if native.available else f"off: {native.detail}",
        "shapes": shapes,
        "quant_shapes": quant_shapes,
        "rows": {"decode": list(counts.decode), "prefill": list(counts.prefill)},
    }


def key_digest(key: JsonObject) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def cache_dir() -> Path:
    return cache_root() / "gemm"


def load_entry(path: Path, key: JsonObject | None) -> Calibration | None:
    """The cached calibration at ``path``; None when missing, unreadable, malformed, or (``key`` given)
    measured under another key or lacking the timings the key's weights call for."""
    try:
        document = json.loads(path.read_text())
        timings, quant_timings = timings_from_json(document)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError):
        return None
    if key is not None and (
        document.get("key") != key
        or bool(key["shapes"]) != bool(timings)
        or bool(key["quant_shapes"]) != bool(quant_timings)
    ):
        return None
    return Calibration.from_timings(timings, f"cache {path}", document.get("key"), quant_timings)


def store_entry(path: Path, calibration: Calibration) -> None:
    """Write atomically (a concurrent reader never sees half a file); a failure to write is only logged."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".json.tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(calibration.to_json(), f, indent=1)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not cache the GEMM calibration at %s: %s", path, exc)


_memo: dict[str, Calibration] = {}


def calibrate(
    weights: Sequence[LinearWeight],
    counts: RowCounts,
    *,
    quant_weights: Sequence[QuantLinearWeight] = (),
    measure: Measure = time_passes,
    measure_quant: QuantMeasure = time_quant_passes,
    refresh: bool = False,
) -> Calibration:
    """The calibration for these fp32 and quantized weights and row counts: memoised, else cached on disk,
    else measured (each measurement only when it has weights; at least one list must be non-empty).

    ``refresh`` measures again and overwrites the cache entry. Measuring mutates the thread pools' state
    (torch's pool is left at its full thread count).
    """
    if not torch_pool.parked:  # a count set by torch.set_num_threads is the one to measure and keep
        torch_pool.set_full(torch.get_num_threads())
    key = calibration_key(weights, counts, quant_weights)
    digest = key_digest(key)
    path = cache_dir() / f"table-{digest}.json"
    if not refresh:
        found = _memo.get(digest) or load_entry(path, key)
        if found is not None:
            _memo[digest] = found
            return found
    try:
        timings = measure(weights, counts) if weights else []
        quant_timings = measure_quant(quant_weights, counts) if quant_weights else []
    finally:
        torch_pool.restore()
    calibration = Calibration.from_timings(timings, "measured", key, quant_timings)
    store_entry(path, calibration)
    _memo[digest] = calibration
    return calibration


def env_calibration() -> Calibration | None:
    """The table ``PAGEDGEN_GEMM_TABLE`` names, or None when unset. Raises ``ValueError`` for a value that is
    neither a backend name nor a readable calibration file."""
    value = os.environ.get(TABLE_ENV, "").strip()
    if not value or value == "auto":
        return None
    source = f"{TABLE_ENV}={value}"
    if value in FIXED_TABLES:
        quant = FIXED_QUANT_TABLES[value]
        return Calibration(
            FIXED_TABLES[value],
            (f"{value} for every call ({source})",),
            source,
            quant=quant,
            quant_reasons=(f"{quant.default.value} for every call ({source})",),
        )
    entry = load_entry(Path(value), key=None)
    if entry is None:
        raise ValueError(f"{TABLE_ENV}={value!r}: not one of auto, {', '.join(FIXED_TABLES)} or a table file")
    return replace(entry, source=source)


def adapt_to_model(
    runtime: object,
    linear_types: tuple[type, ...],
    max_batch_size: int,
    max_scheduled_tokens: int,
    chunk_size: int | None = None,
    *,
    measure: Measure = time_passes,
    measure_quant: QuantMeasure = time_quant_passes,
) -> Calibration | None:
    """Install the tables for this model's linear layers (modules of ``linear_types``) at the engine's row
    counts: the GEMM table for its CPU fp32 weights, the quantized-path table for its weights kept in their
    stored format (when the native kernels exist: without them every such call dequantises anyway).

    Returns what was chosen, or None when nothing was installed: the tables are pinned, or the model has
    no such layers (the synthetic test model, CUDA or half precision). A pinned table stands; the other
    one is still measured. Raises ``ValueError`` for a bad ``PAGEDGEN_GEMM_TABLE``.
    """
    gemm_free, quant_free = not table_pinned(), not quant_table_pinned()
    if not (gemm_free or quant_free):
        return None
    fixed = env_calibration()
    if fixed is not None:
        return fixed if _install(fixed) else None
    weights = model_linear_weights(runtime, linear_types) if gemm_free else []
    measurable = quant_free and quant_kernels() is not None
    quant_weights = model_quant_weights(runtime, linear_types) if measurable else []
    if not weights and not quant_weights:
        return None
    counts = engine_row_counts(max_batch_size, max_scheduled_tokens, chunk_size)
    calibration = calibrate(
        weights, counts, quant_weights=quant_weights, measure=measure, measure_quant=measure_quant
    )
    if not _install(calibration):
        return None
    for name, table in (("GEMM", calibration.table), ("quantized-path", calibration.quant)):
        if table is not None:
            log.info("%s table (%s): %s", name, calibration.source, table.describe())
    return calibration


def _install(calibration: Calibration) -> bool:
    """Adopt each table the calibration has, unless pinned; True if either was installed."""
    gemm = calibration.table is not None and adopt_table(calibration.table)
    quant = calibration.quant is not None and adopt_quant_table(calibration.quant)
    return gemm or quant
