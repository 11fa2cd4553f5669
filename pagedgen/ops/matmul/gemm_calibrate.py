"""Measure the GEMM backends on this machine and derive a :class:`GemmTable` with a reason per choice.

Why on the model's own weights, in blocks that alternate between the candidates, keeping each one's best: a
decode step streams every weight, so the measured pass must too, and on a shared machine the least-disturbed
block is the closest estimate of what the hardware does. docs/performance.md, "Module notes: ops and bench",
has the rest.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np
import torch

from pagedgen.ops.kernels.native import gemm_kernel
from pagedgen.ops.matmul.gemm import GemmBackend, GemmTable, RowBucket, native_gemm, openblas_gemm, torch_gemm

DRAM_BYTES = 192 << 20  # enough distinct weights per shape to stream from memory, not cache
SHARED_DECODE_ROWS = 32  # decode widths every engine measures (see engine_row_counts)
BUDGET_S = 3.0  # seconds of repeats at engine start (one round always runs)
SETTLE_S = 0.15  # untimed running before a backend's passes: the previous pool's spin-wait ends

Gemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
Member = TypeVar("Member", bound="PassMember")


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


class _Timed(Protocol):
    @property
    def rows(self) -> int: ...

    @property
    def seconds(self) -> dict[GemmBackend, float]: ...


def derive_table(timings: Sequence[_Timed]) -> GemmTable:
    """Per row count, the backend with the smaller summed time over all shapes; merged into row buckets.

    A measured row count ``r`` covers the rows above the previous measured count up to ``r``; rows above
    the largest take its backend.
    """
    rows = sorted({t.rows for t in timings})
    winner = {r: _fastest(_totals(timings, r)) for r in rows}
    buckets: list[RowBucket] = []
    for r in rows:
        if buckets and buckets[-1].backend is winner[r]:
            buckets[-1] = RowBucket(r, winner[r])
        else:
            buckets.append(RowBucket(r, winner[r]))
    default = buckets.pop().backend if buckets else GemmBackend.TORCH
    return GemmTable(buckets=tuple(buckets), default=default)


def _totals(timings: Iterable[_Timed], rows: int) -> dict[GemmBackend, float]:
    total: dict[GemmBackend, float] = {}
    for t in timings:
        if t.rows == rows:
            for backend, seconds in t.seconds.items():
                total[backend] = total.get(backend, 0.0) + seconds
    return total


def _fastest(seconds: dict[GemmBackend, float]) -> GemmBackend:
    # Ties (equal best times) go to the earlier backend in GemmBackend's order: torch first.
    return min(seconds, key=lambda b: (seconds[b], list(GemmBackend).index(b)))


# -- whole-model passes: what the engine measures at start ---------------------------------------------


@dataclass(frozen=True, slots=True)
class LinearWeight:
    """One weight a forward multiplies by; ``every_token`` is False for the LM head (sampled rows only)."""

    weight: torch.Tensor  # [out, in]
    every_token: bool

    @property
    def shape(self) -> tuple[int, int]:
        """``(in_features, out_features)``."""
        return int(self.weight.shape[1]), int(self.weight.shape[0])

    @property
    def kind(self) -> tuple[int, int]:
        """What a prefill pass takes at least one of (:func:`pass_members`): the shape."""
        return self.shape

    @property
    def numel(self) -> int:
        return self.weight.numel()


def model_linear_weights(runtime: object, linear_types: tuple[type, ...]) -> list[LinearWeight]:
    """The fp32 CPU weights of ``runtime``'s linear layers (modules of ``linear_types``, e.g. the model
    family's ``Linear``: ops cannot import the models), each once, in module order.

    Fused projections (q/k/v, gate/up) count once: a layer whose weight is a view into a larger weight of
    another layer (the fused one) is left out. The LM head (``runtime.head_weight``, perhaps the tied
    embedding) is marked ``every_token=False``. A model without such layers (the synthetic test model, a
    CUDA or half-precision model) gives an empty list.
    """
    by_storage: dict[int, torch.Tensor] = {}
    for module in runtime.modules() if hasattr(runtime, "modules") else ():
        if isinstance(module, linear_types) and _gemm_weight(module.weight):
            key = module.weight.untyped_storage().data_ptr()
            if key not in by_storage or by_storage[key].numel() < module.weight.numel():
                by_storage[key] = module.weight
    head = getattr(runtime, "head_weight", None)
    head_ptr = head.data_ptr() if isinstance(head, torch.Tensor) and _gemm_weight(head) else None
    weights = [LinearWeight(w, every_token=w.data_ptr() != head_ptr) for w in by_storage.values()]
    if head_ptr is not None and all(w.every_token for w in weights):
        weights.append(LinearWeight(head, every_token=False))
    return weights


def _gemm_weight(weight: object) -> bool:
    """An fp32 CPU matrix the GEMM backends can take (quantized weights have their own kernel)."""
    return (
        isinstance(weight, torch.Tensor)
        and weight.dtype is torch.float32
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.is_contiguous()
    )


@dataclass(frozen=True, slots=True)
class RowCounts:
    """The step sizes to measure: decode widths (every weight, LM head included) and prefill sizes."""

    decode: tuple[int, ...]
    prefill: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("decode", "prefill"):
            values = getattr(self, name)
            if list(values) != sorted(set(values)) or any(v <= 0 for v in values):
                raise ValueError(f"RowCounts.{name} must be ascending positive ints, got {values!r}")
        if self.decode and self.prefill and self.prefill[0] <= self.decode[-1]:
            raise ValueError(f"RowCounts.prefill {self.prefill} must lie above decode {self.decode}")


def engine_row_counts(
    max_batch_size: int, max_scheduled_tokens: int, chunk_size: int | None = None
) -> RowCounts:
    """The row counts an engine's steps produce, sampled: decode widths 1, 2, 4, ... up to
    ``max(max_batch_size, SHARED_DECODE_ROWS)`` and ``max_batch_size``; prefill sizes 4x, 16x, ... the widest
    decode width below ``max_scheduled_tokens``, the chunk size, and ``max_scheduled_tokens``.

    E.g. (16, 2048) and (32, 2048): decode 1, 2, ..., 32; prefill 128, 512, 2048. Measuring decode widths
    up to 32 for every engine lets engines of different batch sizes share one cached measurement.
    """
    widest = max(max_batch_size, SHARED_DECODE_ROWS)
    decode = {1 << i for i in range(widest.bit_length())} | {max_batch_size}
    prefill = {max_scheduled_tokens} | ({chunk_size} if chunk_size else set())
    size = 4 * max(decode)
    while size < max_scheduled_tokens:
        prefill.add(size)
        size *= 4
    return RowCounts(tuple(sorted(decode)), tuple(sorted(p for p in prefill if p > max(decode))))


@dataclass(frozen=True, slots=True)
class PassTiming:
    """Best seconds of one pass over the weights at ``rows`` rows, per backend, and the pass's FLOPs."""

    rows: int
    flops: float
    seconds: dict[GemmBackend, float]

    def gflops(self, backend: GemmBackend) -> float:
        return self.flops / self.seconds[backend] / 1e9

    @property
    def fastest(self) -> GemmBackend:
        return _fastest(self.seconds)

    def reason(self) -> str:
        """e.g. ``torch 115.2 GFLOP/s; openblas 76.4 (0.66x); native 62.5 (0.54x)``, fastest first."""
        best = self.fastest
        order = sorted(self.seconds, key=lambda b: (b is not best, self.seconds[b]))
        parts = [f"{best.value} {self.gflops(best):.1f} GFLOP/s"]
        parts += [
            f"{b.value} {self.gflops(b):.1f} ({self.seconds[best] / self.seconds[b]:.2f}x)" for b in order[1:]
        ]
        return "; ".join(parts)


class PassMember(Protocol):
    """What :func:`pass_members` reads of a weight: fp32 (:class:`LinearWeight`) or quantized alike."""

    @property
    def every_token(self) -> bool: ...

    @property
    def kind(self) -> Hashable: ...

    @property
    def numel(self) -> int: ...


def pass_weights(weights: Sequence[LinearWeight], rows: int, counts: RowCounts) -> list[torch.Tensor]:
    """The matrices a pass at ``rows`` multiplies by (:func:`pass_members`)."""
    return [w.weight for w in pass_members(weights, rows, counts)]


def pass_members(weights: Sequence[Member], rows: int, counts: RowCounts) -> list[Member]:
    """What a pass at ``rows`` multiplies by.

    At a decode width: every weight, so the pass streams the model like a decode step. Above: the per-token
    weights in model order, as many as fit the FLOPs of a pass at the widest decode width (at least one of
    each kind), so a prefill-sized pass costs no more than a decode one while its weights still come from
    as far away as a budget allows (a single reused weight would sit in cache and flatter the small
    kernels at 64-256 rows).
    """
    if rows in counts.decode:
        return list(weights)
    per_token = [w for w in weights if w.every_token]
    widest = counts.decode[-1] if counts.decode else 1
    budget = 2 * widest * sum(w.numel for w in per_token)
    chosen: list[Member] = []
    kinds: set[Hashable] = set()
    flops = 0
    for w in per_token:
        cost = 2 * rows * w.numel
        if flops + cost > budget and w.kind in kinds:
            continue
        chosen.append(w)
        kinds.add(w.kind)
        flops += cost
    return chosen


def time_passes(
    weights: Sequence[LinearWeight],
    counts: RowCounts,
    budget_s: float = BUDGET_S,
    max_rounds: int = 3,
    gemms: dict[GemmBackend, Gemm] | None = None,
) -> list[PassTiming]:
    """Best seconds per backend of a :func:`pass_weights` pass at every row count.

    Rounds: each round times, backend by backend, one pass per row count; rounds repeat (best kept, at
    most ``max_rounds``) while another would end within ``budget_s``. One round took 2.5-4 s on 2 quiet
    cores for a 135M-parameter model; a loaded machine gets fewer repeats, so a noisier table, rather than
    a slower start (``pagedgen bench gemm --recalibrate`` measures again).

    Before a backend's passes it runs untimed for :data:`SETTLE_S`: the previous backend's pool may still
    spin (OpenBLAS's workers for ~0.1 s after a call) and would slow the first passes of the next one; a
    pass at one row lasts only ~30 ms. The first settle also touches every weight, which a freshly loaded
    (memory-mapped) model would otherwise page in during the first timed pass.
    """
    gemms = available_backends() if gemms is None else gemms
    rows_list = (*counts.decode, *counts.prefill)
    plans = [(rows, _calls(pass_weights(weights, rows, counts), rows)) for rows in rows_list]
    warm = _calls([w.weight for w in weights], 1)
    best = {rows: dict.fromkeys(gemms, float("inf")) for rows in rows_list}
    start = time.perf_counter()
    with torch.inference_mode():
        for done in range(1, max_rounds + 1):
            for backend, gemm in gemms.items():
                _settle(gemm, warm)
                for rows, calls in plans:
                    began = time.perf_counter()
                    _run(gemm, calls)
                    best[rows][backend] = min(best[rows][backend], time.perf_counter() - began)
            elapsed = time.perf_counter() - start
            if elapsed + elapsed / done > budget_s:
                break
    return [PassTiming(rows, _flops(calls), best[rows]) for rows, calls in plans]


def _calls(weights: Sequence[torch.Tensor], rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(x [rows, in], w)`` per weight; one random ``x`` per input size."""
    gen = torch.Generator().manual_seed(rows)
    inputs = {k: torch.randn(rows, k, generator=gen) for k in sorted({int(w.shape[1]) for w in weights})}
    return [(inputs[int(w.shape[1])], w) for w in weights]


def _flops(calls: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
    return float(sum(2 * x.shape[0] * w.numel() for x, w in calls))


def _settle(gemm: Gemm, calls: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    began = time.perf_counter()
    while True:
        _run(gemm, calls)
        if time.perf_counter() - began >= SETTLE_S:
            return


def _run(gemm: Gemm, calls: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for x, w in calls:
        gemm(x, w, None)


def explain_table(timings: Sequence[PassTiming]) -> list[str]:
    """One line per measured row count: the bucket it decides and why, e.g.
    ``rows<=8 (measured at 8): native 31.2 GFLOP/s; openblas 22.0 (0.71x); torch 15.1 (0.48x)``."""
    lines, previous = [], 0
    for t in sorted(timings, key=lambda t: t.rows):
        lines.append(f"rows {previous + 1}-{t.rows} (measured at {t.rows}): {t.reason()}")
        previous = t.rows
    if lines:
        lines.append(f"rows above {previous}: as at {previous}")
    return lines
