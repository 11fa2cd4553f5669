"""Time the two paths of a linear layer over a weight kept in its stored format; derive a :class:`QuantTable`.

Why one crossover per kind: where the kernel stops beating dequantise + GEMM differs by format and shape, and
each path's time is close to affine in the rows, so they cross once; a crossover chosen over every measured
row count (each count's loss capped at 8x) survives the one disturbed pass that a per-count choice would
follow. docs/performance.md, "Module notes: ops and bench", has the rest.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pagedgen.ops.matmul.gemm_calibrate import BUDGET_S, SETTLE_S, RowCounts, pass_members
from pagedgen.ops.matmul.quant_gemm import quant_gemm, quant_kernels, tiled_dequant_gemm
from pagedgen.ops.matmul.quant_table import QuantBucket, QuantOverride, QuantPath, QuantTable, kind_name
from pagedgen.ops.matmul.qweight import QType, QuantizedWeight

QuantGemm = Callable[[torch.Tensor, QuantizedWeight, torch.Tensor | None], torch.Tensor]
Kind = tuple[QType, tuple[int, int]]  # (format, (out, in))


def available_paths() -> dict[QuantPath, QuantGemm]:
    """The paths this machine can run: the kernel needs the compiled native library."""
    paths: dict[QuantPath, QuantGemm] = {}
    if quant_kernels() is not None:
        paths[QuantPath.KERNEL] = quant_gemm
    paths[QuantPath.DEQUANT] = tiled_dequant_gemm
    return paths


@dataclass(frozen=True, slots=True)
class QuantLinearWeight:
    """One quantized weight a forward multiplies by; ``every_token`` is False for the LM head."""

    weight: QuantizedWeight
    every_token: bool

    @property
    def kind(self) -> Kind:
        return self.weight.qtype, tuple(self.weight.shape)

    @property
    def numel(self) -> int:
        return self.weight.shape[0] * self.weight.shape[1]

    @property
    def name(self) -> str:
        """e.g. ``Q4_1 576->960`` (:func:`~pagedgen.ops.matmul.quant_table.kind_name`), `` head`` appended."""
        return kind_name(*self.kind) + ("" if self.every_token else " head")


def model_quant_weights(runtime: object, linear_types: tuple[type, ...]) -> list[QuantLinearWeight]:
    """The :class:`QuantizedWeight` of ``runtime``'s linear layers (modules of ``linear_types``), each once,
    in module order, and the LM head (``runtime.head_weight``, perhaps the tied embedding) marked
    ``every_token=False``.

    A fused projection counts once: a weight whose blocks lie inside another's (a part of the fused q/k/v,
    ``QuantizedWeight.rows``) is left out, and the fused one stands where its first part stood.
    """
    found = [
        module.weight
        for module in (runtime.modules() if hasattr(runtime, "modules") else ())
        if isinstance(module, linear_types) and isinstance(module.weight, QuantizedWeight)
    ]
    head = getattr(runtime, "head_weight", None)
    candidates = [*found, head] if isinstance(head, QuantizedWeight) else found
    outer = _outermost(candidates)
    head_outer = outer[id(head)] if isinstance(head, QuantizedWeight) else None
    weights, seen = [], set()
    for w in candidates:
        chosen = outer[id(w)]
        if id(chosen) not in seen:
            seen.add(id(chosen))
            weights.append(QuantLinearWeight(chosen, every_token=chosen is not head_outer))
    return weights


def _outermost(weights: Sequence[QuantizedWeight]) -> dict[int, QuantizedWeight]:
    """``id(w)`` -> the widest weight whose blocks contain ``w``'s (``w`` itself when none does)."""
    outer: dict[int, QuantizedWeight] = {}
    current, current_end = None, -1
    for w in sorted(weights, key=lambda w: (w.data.data_ptr(), -w.nbytes)):
        start = w.data.data_ptr()
        if current is None or start + w.nbytes > current_end:
            current, current_end = w, start + w.nbytes
        outer[id(w)] = current
    return outer


@dataclass(frozen=True, slots=True)
class QuantPassTiming:
    """Best seconds per path of one kind's calls in the pass at ``rows`` rows, and their FLOPs."""

    rows: int
    qtype: QType
    shape: tuple[int, int]  # (out, in)
    flops: float
    seconds: dict[QuantPath, float]

    @property
    def name(self) -> str:
        return kind_name(self.qtype, self.shape)


def time_quant_passes(
    weights: Sequence[QuantLinearWeight],
    counts: RowCounts,
    budget_s: float = BUDGET_S,
    max_rounds: int = 3,
    paths: dict[QuantPath, QuantGemm] | None = None,
) -> list[QuantPassTiming]:
    """Best seconds per path and kind of a :func:`~pagedgen.ops.matmul.gemm_calibrate.pass_members` pass at
    every row count; rounds and budget as in :func:`~pagedgen.ops.matmul.gemm_calibrate.time_passes`.

    Unlike there, the paths alternate per row count within a round (kernel pass, dequantise pass, next row
    count), so the two passes compared at a count run back to back: on a shared machine, load comes in
    episodes of a fraction of a second to seconds, and two passes that far apart can land one inside an
    episode and one outside. Both paths run on torch's thread count and no OpenBLAS pool is involved, so
    one settle per path before the first round suffices (it also pages in a freshly loaded model).
    """
    paths = available_paths() if paths is None else paths
    rows_list = (*counts.decode, *counts.prefill)
    plans = [(rows, _calls(pass_members(weights, rows, counts), rows)) for rows in rows_list]
    warm = _calls(weights, 1)
    best: dict[tuple[int, Kind], dict[QuantPath, float]] = {}
    start = time.perf_counter()
    with torch.inference_mode():
        for gemm in paths.values():
            _settle(gemm, warm)
        for done in range(1, max_rounds + 1):
            for rows, calls in plans:
                for path, gemm in paths.items():
                    for kind, seconds in _timed_pass(gemm, calls).items():
                        slot = best.setdefault((rows, kind), dict.fromkeys(paths, float("inf")))
                        slot[path] = min(slot[path], seconds)
            elapsed = time.perf_counter() - start
            if elapsed + elapsed / done > budget_s:
                break
    flops = {(rows, kind): 0.0 for rows, kind in best}
    for rows, calls in plans:
        for kind, _, w in calls:
            flops[rows, kind] += 2.0 * rows * w.shape[0] * w.shape[1]
    return [QuantPassTiming(rows, kind[0], kind[1], flops[rows, kind], s) for (rows, kind), s in best.items()]


Call = tuple[Kind, torch.Tensor, QuantizedWeight]


def _calls(weights: Sequence[QuantLinearWeight], rows: int) -> list[Call]:
    """``(kind, x [rows, in], w)`` per weight; one random ``x`` per input size."""
    gen = torch.Generator().manual_seed(rows)
    sizes = sorted({w.weight.shape[1] for w in weights})
    inputs = {k: torch.randn(rows, k, generator=gen) for k in sizes}
    return [(w.kind, inputs[w.weight.shape[1]], w.weight) for w in weights]


def _timed_pass(gemm: QuantGemm, calls: Sequence[Call]) -> dict[Kind, float]:
    """Seconds per kind of one pass: the kind's median call times its number of calls (see the module
    docstring for why not the plain sum)."""
    spent: dict[Kind, list[float]] = {}
    for kind, x, w in calls:
        began = time.perf_counter()
        gemm(x, w, None)
        spent.setdefault(kind, []).append(time.perf_counter() - began)
    return {kind: statistics.median(times) * len(times) for kind, times in spent.items()}


def _settle(gemm: QuantGemm, calls: Sequence[Call]) -> None:
    began = time.perf_counter()
    while True:
        for _, x, w in calls:
            gemm(x, w, None)
        if time.perf_counter() - began >= SETTLE_S:
            return


# -- the table and its reasons ---------------------------------------------------------------------------

Measured = Sequence[tuple[int, dict[QuantPath, float], float]]  # (rows, seconds per path, flops), ascending

# One count's loss is capped at 8x: on a loaded machine a pass of small calls can land in a scheduler episode
# and read 100x slower on either path (measured: a Gemma 3 file's 256 x 640 k and v weights, kernel 0.01x at
# 2 rows between wins at every other count), and uncapped that one count outweighed all the others, which
# chose dequantise + GEMM even at one row for those weights (and so the per-layer path for every decode step).
MAX_LOSS = math.log(8.0)


def derive_quant_table(timings: Sequence[QuantPassTiming]) -> QuantTable:
    """Per kind, the kernel up to its :func:`crossover` and dequantise + GEMM above (the overrides); for
    other kinds the same over the times summed across kinds at each row count (the table's buckets)."""
    overrides = []
    for (qtype, shape), measured in _by_kind(timings).items():
        overrides.append(QuantOverride(qtype, shape, _kernel_up_to(crossover(measured)), QuantPath.DEQUANT))
    buckets = _kernel_up_to(crossover(_summed(timings)))
    return QuantTable(buckets=buckets, default=QuantPath.DEQUANT, overrides=tuple(overrides))


def crossover(measured: Measured) -> int:
    """The largest row count the kernel runs at: 0 (never) or a measured count, chosen to minimise the
    summed ``log(chosen / faster)`` over the measured counts (module docstring); ties go to the kernel."""
    counts = [rows for rows, _, _ in measured]
    losses = {}
    for limit in [0, *counts]:
        losses[limit] = sum(_loss(seconds, _side(rows, limit)) for rows, seconds, _ in measured)
    return min(losses, key=lambda limit: (losses[limit], -limit))


def explain_quant_table(timings: Sequence[QuantPassTiming]) -> list[str]:
    """One line per kind and measured row count, then the all-kinds sums, e.g.
    ``Q4_1 576->960 rows 1-1 (measured at 1): kernel 9.8 GFLOP/s; dequant 1.1 (0.11x)``; a count the
    crossover overrules says so."""
    lines: list[str] = []
    for (qtype, shape), measured in _by_kind(timings).items():
        lines += _explain(kind_name(qtype, shape), measured)
    lines += _explain("other kinds (all summed)", _summed(timings))
    return lines


def _explain(name: str, measured: Measured) -> list[str]:
    limit = crossover(measured)
    lines, previous = [f"{name}: kernel up to {limit} rows" if limit else f"{name}: never the kernel"], 0
    for rows, seconds, flops in measured:
        line = f"  rows {previous + 1}-{rows} (measured at {rows}): {_reason(seconds, flops)}"
        chosen = _side(rows, limit)
        if chosen is not _fastest(seconds) and chosen in seconds:
            line += f" -> {chosen.value} (the crossover)"
        lines.append(line)
        previous = rows
    return lines


def _by_kind(timings: Sequence[QuantPassTiming]) -> dict[Kind, Measured]:
    kinds: dict[Kind, list[tuple[int, dict[QuantPath, float], float]]] = {}
    for t in sorted(timings, key=lambda t: t.rows):
        kinds.setdefault((t.qtype, tuple(t.shape)), []).append((t.rows, t.seconds, t.flops))
    return kinds


def _summed(timings: Sequence[QuantPassTiming]) -> Measured:
    rows: dict[int, tuple[dict[QuantPath, float], list[float]]] = {}
    for t in sorted(timings, key=lambda t: t.rows):
        seconds, flops = rows.setdefault(t.rows, ({}, [0.0]))
        for path, s in t.seconds.items():
            seconds[path] = seconds.get(path, 0.0) + s
        flops[0] += t.flops
    return [(r, seconds, flops[0]) for r, (seconds, flops) in rows.items()]


def _side(rows: int, limit: int) -> QuantPath:
    return QuantPath.KERNEL if rows <= limit else QuantPath.DEQUANT


def _loss(seconds: dict[QuantPath, float], chosen: QuantPath) -> float:
    if chosen not in seconds:  # the kernel was not measured (no native library): never choose it
        return math.inf
    return min(math.log(seconds[chosen] / min(seconds.values())), MAX_LOSS)


def _kernel_up_to(limit: int) -> tuple[QuantBucket, ...]:
    return (QuantBucket(limit, QuantPath.KERNEL),) if limit else ()


def _fastest(seconds: dict[QuantPath, float]) -> QuantPath:
    # Ties go to the earlier path in QuantPath's order: the kernel (it makes no fp32 copy of the weight).
    return min(seconds, key=lambda p: (seconds[p], list(QuantPath).index(p)))


def _reason(seconds: dict[QuantPath, float], flops: float) -> str:
    """``kernel 31.2 GFLOP/s; dequant 22.0 (0.71x)``, the faster first."""
    best = _fastest(seconds)
    order = sorted(seconds, key=lambda p: (p is not best, seconds[p]))
    parts = [f"{best.value} {flops / seconds[best] / 1e9:.1f} GFLOP/s"]
    parts += [
        f"{p.value} {flops / seconds[p] / 1e9:.1f} ({seconds[best] / seconds[p]:.2f}x)" for p in order[1:]
    ]
    return "; ".join(parts)
