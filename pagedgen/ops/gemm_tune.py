"""Adapt the GEMM table to the machine: measure once per machine and model, cache the result, install it.

Why: the fastest backend per row count depends on the CPU, the libraries and the thread count (an AVX2
EPYC and an AVX-512 Xeon disagree, docs/performance.md), so nothing about it is fixed in code. At engine
start :func:`adapt_to_model` times torch, OpenBLAS and (when it can be built) the native kernel on the
model's own linear weights at the row counts the engine's steps produce (:mod:`pagedgen.ops.gemm_calibrate`)
and installs the fastest per row count, unless a table was pinned (:func:`pagedgen.ops.gemm.set_gemm_table`).

The measurement is cached as JSON in ``<cache root>/gemm/``, keyed by everything it depends on
(:func:`calibration_key`): CPU model and flags, thread counts, torch and numpy versions, numpy's BLAS
library and kernel family, the native library (its file name hashes sources, flags, compiler and CPU) or
why it is off, the weight shapes and the row counts. Any change gives a new entry; an entry that does not
parse or whose stored key differs is measured again and overwritten. Within a process, a key is measured or
read once.

``PAGEDGEN_GEMM_TABLE`` overrides the measurement for reproducibility: ``torch``, ``openblas`` or
``native`` (one backend for every call), or the path of a cache entry (its timings decide, whatever machine
they came from).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedgen.core.paths import cache_root
from pagedgen.ops.cpu_info import cpu_flags, cpu_model
from pagedgen.ops.gemm import (
    NATIVE_ONLY,
    OPENBLAS_ONLY,
    TORCH_ONLY,
    GemmBackend,
    GemmTable,
    adopt_table,
    table_pinned,
)
from pagedgen.ops.gemm_calibrate import (
    LinearWeight,
    PassTiming,
    RowCounts,
    derive_table,
    engine_row_counts,
    explain_table,
    model_linear_weights,
    time_passes,
)
from pagedgen.ops.gemm_threads import current_thread_settings, torch_pool
from pagedgen.ops.native import native_status

log = logging.getLogger(__name__)

TABLE_ENV = "PAGEDGEN_GEMM_TABLE"
METHOD_VERSION = 1  # bump when the measurement changes meaning: every cached entry is then re-measured
FIXED_TABLES = {"torch": TORCH_ONLY, "openblas": OPENBLAS_ONLY, "native": NATIVE_ONLY}

Measure = Callable[[Sequence[LinearWeight], RowCounts], list[PassTiming]]


@dataclass(frozen=True, slots=True)
class Calibration:
    """A table and where it came from: measured timings (with the key they were measured under) or a
    fixed choice. ``source`` says which: ``measured``, ``cache <path>``, ``PAGEDGEN_GEMM_TABLE=...``."""

    table: GemmTable
    reasons: tuple[str, ...]
    source: str
    key: dict[str, Any] | None = None
    timings: tuple[PassTiming, ...] = ()

    @classmethod
    def from_timings(
        cls, timings: Sequence[PassTiming], source: str, key: dict[str, Any] | None
    ) -> Calibration:
        return cls(derive_table(timings), tuple(explain_table(timings)), source, key, tuple(timings))

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "table": self.table.describe(),
            "reasons": list(self.reasons),
            "timings": [
                {"rows": t.rows, "flops": t.flops, "seconds": {b.value: s for b, s in t.seconds.items()}}
                for t in self.timings
            ],
        }


def timings_from_json(document: dict[str, Any]) -> tuple[PassTiming, ...]:
    """The timings of a cache entry; raises ``KeyError``/``ValueError``/``TypeError`` when malformed."""
    timings = tuple(
        PassTiming(
            int(t["rows"]),
            float(t["flops"]),
            {GemmBackend(name): float(s) for name, s in t["seconds"].items()},
        )
        for t in document["timings"]
    )
    if not timings or any(not t.seconds or min(t.seconds.values()) <= 0 for t in timings):
        raise ValueError("a calibration entry needs positive timings")
    return timings


def calibration_key(weights: Sequence[LinearWeight], counts: RowCounts) -> dict[str, Any]:
    """Everything a measured choice depends on (see the module docstring); JSON-serialisable."""
    threads = current_thread_settings()
    native = native_status()
    shapes: dict[str, int] = {}
    for w in weights:
        name = f"{w.shape[0]}x{w.shape[1]}{'' if w.every_token else ' head'}"
        shapes[name] = shapes.get(name, 0) + 1
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
        "rows": {"decode": list(counts.decode), "prefill": list(counts.prefill)},
    }


def key_digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def cache_dir() -> Path:
    return cache_root() / "gemm"


def load_entry(path: Path, key: dict[str, Any] | None) -> Calibration | None:
    """The cached calibration at ``path``; None when missing, unreadable, malformed, or (``key`` given)
    measured under another key."""
    try:
        document = json.loads(path.read_text())
        timings = timings_from_json(document)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if key is not None and document.get("key") != key:
        return None
    return Calibration.from_timings(timings, f"cache {path}", document.get("key"))


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
    measure: Measure = time_passes,
    refresh: bool = False,
) -> Calibration:
    """The calibration for these weights and row counts: memoised, else cached on disk, else measured.

    ``refresh`` measures again and overwrites the cache entry. Measuring mutates the thread pools' state
    (torch's pool is left at its full thread count).
    """
    if not torch_pool.parked:  # a count set by torch.set_num_threads is the one to measure and keep
        torch_pool.set_full(torch.get_num_threads())
    key = calibration_key(weights, counts)
    digest = key_digest(key)
    path = cache_dir() / f"table-{digest}.json"
    if not refresh:
        found = _memo.get(digest) or load_entry(path, key)
        if found is not None:
            _memo[digest] = found
            return found
    try:
        timings = measure(weights, counts)
    finally:
        torch_pool.restore()
    calibration = Calibration.from_timings(timings, "measured", key)
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
        return Calibration(FIXED_TABLES[value], (f"{value} for every call ({source})",), source)
    entry = load_entry(Path(value), key=None)
    if entry is None:
        raise ValueError(f"{TABLE_ENV}={value!r}: not one of auto, {', '.join(FIXED_TABLES)} or a table file")
    return Calibration(entry.table, entry.reasons, source, entry.key, entry.timings)


def adapt_to_model(
    runtime: Any,
    linear_types: tuple[type, ...],
    max_batch_size: int,
    max_scheduled_tokens: int,
    chunk_size: int | None = None,
    *,
    measure: Measure = time_passes,
) -> Calibration | None:
    """Install the table for this model's CPU fp32 linear layers (modules of ``linear_types``) at the
    engine's row counts.

    Returns what was chosen, or None when nothing was: a pinned table stands, or the model has no such
    layers (the synthetic test model, CUDA or half precision). Raises ``ValueError`` for a bad
    ``PAGEDGEN_GEMM_TABLE``.
    """
    if table_pinned():
        return None
    fixed = env_calibration()
    if fixed is not None:
        adopt_table(fixed.table)
        return fixed
    weights = model_linear_weights(runtime, linear_types)
    if not weights:
        return None
    counts = engine_row_counts(max_batch_size, max_scheduled_tokens, chunk_size)
    calibration = calibrate(weights, counts, measure=measure)
    if adopt_table(calibration.table):
        log.info("GEMM table (%s): %s", calibration.source, calibration.table.describe())
        return calibration
    return None
