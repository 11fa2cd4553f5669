"""ops.matmul.quant_calibrate: which quantized weights are measured, how the crossover per kind follows from
timings, and the reasons printed for it.

The timings are synthetic; the one real measurement runs on weights of a few KB and asserts only what was
measured, never how fast.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pagedgen.models.llama import Linear
from pagedgen.models.synthetic import SyntheticModel
from pagedgen.ops.matmul import quant_calibrate
from pagedgen.ops.matmul.gemm_calibrate import RowCounts, pass_members
from pagedgen.ops.matmul.quant_calibrate import (
    QuantPassTiming,
    crossover,
    derive_quant_table,
    explain_quant_table,
    model_quant_weights,
    time_quant_passes,
)
from pagedgen.ops.matmul.quant_gemm import quant_kernels
from pagedgen.ops.matmul.quant_table import QuantBucket, QuantOverride, QuantPath, QuantTable
from pagedgen.ops.matmul.qweight import QType
from tests.helpers.linear import QuantRuntime

pytestmark = pytest.mark.cpu  # the quantized CPU paths are measured

KERNEL, DEQUANT = QuantPath.KERNEL, QuantPath.DEQUANT
LINEAR = (Linear,)
Q4, Q8 = QType.Q4_1, QType.Q8_0
QKV, OUT_PROJ, HEAD = (64, 32), (32, 32), (40, 32)  # (out, in)


def _timing(rows: int, qtype: QType, shape, kernel: float, dequant: float) -> QuantPassTiming:
    return QuantPassTiming(rows, qtype, shape, 1e9, {KERNEL: kernel, DEQUANT: dequant})


def _measured(*pairs: tuple[int, float, float]):
    return [(rows, {KERNEL: k, DEQUANT: d}, 1e9) for rows, k, d in pairs]


# -- the model's quantized weights --------------------------------------------------------------------------


def test_model_weights_count_fused_projections_once_and_mark_the_head():
    weights = model_quant_weights(QuantRuntime(), LINEAR)
    assert [(w.name, w.every_token) for w in weights] == [
        ("Q4_1 32->64", True),  # the fused q/k/v where its first view, q, stood; not its three views
        ("Q4_1 32->32", True),
        ("Q4_1 32->64", True),
        ("Q4_1 32->32", True),
        ("Q8_0 32->40 head", False),  # the tied embedding, sampled rows only
    ]
    unfused = model_quant_weights(QuantRuntime(layers=1, fuse=False), LINEAR)
    assert [w.name for w in unfused] == ["Q4_1 32->32", "Q4_1 32->16", "Q4_1 32->16", "Q4_1 32->32"] + [
        "Q8_0 32->40 head"
    ]


def test_models_without_quantized_linear_layers_have_none():
    assert model_quant_weights(SyntheticModel().runtime, LINEAR) == []
    fp32 = nn.Module()
    fp32.layer = Linear(16, 8, False, torch.float32)
    assert model_quant_weights(fp32, LINEAR) == []


def test_a_prefill_pass_takes_every_kind_within_the_decode_budget():
    weights = model_quant_weights(QuantRuntime(layers=3), LINEAR)
    counts = RowCounts((1, 2), (64,))
    assert pass_members(weights, 2, counts) == weights
    chosen = pass_members(weights, 64, counts)  # budget: 2 rows x 3 layers, so one of each kind, no head
    assert [w.name for w in chosen] == ["Q4_1 32->64", "Q4_1 32->32"]


# -- the crossover and the table -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pairs, limit",
    [
        (((1, 1.0, 5.0), (8, 2.0, 4.0), (64, 9.0, 6.0), (512, 40.0, 20.0)), 8),
        (((1, 1.0, 5.0), (8, 2.0, 4.0)), 8),  # the kernel everywhere measured
        (((1, 6.0, 5.0), (8, 9.0, 4.0)), 0),  # never the kernel
        # one disturbed count inside the kernel's range (kernel 1.2x slower at 4) does not split it
        (((1, 1.0, 5.0), (4, 6.0, 5.0), (8, 2.0, 8.0), (64, 9.0, 6.0)), 8),
        (((1, 1.0, 1.0),), 1),  # a tie goes to the kernel
        # one count disturbed 100x (a scheduler episode) against 3x wins at the others: capped at 8x, it does
        # not turn the kernel off above one row
        (((1, 1.0, 3.0), (2, 100.0, 1.0), (4, 1.0, 3.0), (8, 1.0, 3.0), (16, 1.0, 3.0)), 16),
    ],
    ids=["crosses", "kernel-only", "dequant-only", "one-outlier", "tie", "one-count-100x"],
)
def test_the_crossover_loses_least_against_the_faster_path(pairs, limit):
    assert crossover(_measured(*pairs)) == limit


def test_without_kernel_timings_the_kernel_is_never_chosen():
    assert crossover([(1, {DEQUANT: 1.0}, 1e9), (8, {DEQUANT: 2.0}, 1e9)]) == 0


def test_the_table_has_a_crossover_per_kind_and_one_for_the_sums():
    timings = [
        # Q4_1 q/k/v: the kernel up to 8 rows; Q4_1 o: up to 64; the head (decode widths only): always
        *(_timing(r, Q4, QKV, k, d) for r, k, d in ((1, 1.0, 9.0), (8, 2.0, 3.0), (64, 9.0, 6.0))),
        *(_timing(r, Q4, OUT_PROJ, k, d) for r, k, d in ((1, 1.0, 9.0), (8, 2.0, 3.0), (64, 5.0, 6.0))),
        *(_timing(r, Q8, HEAD, k, d) for r, k, d in ((1, 5.0, 50.0), (8, 6.0, 50.0))),
    ]
    table = derive_quant_table(timings)
    assert table == QuantTable(
        buckets=(QuantBucket(8, KERNEL),),  # sums: kernel 7, 10, 14 against dequant 68, 56, 12
        default=DEQUANT,
        overrides=(
            QuantOverride(Q4, QKV, (QuantBucket(8, KERNEL),), DEQUANT),
            QuantOverride(Q4, OUT_PROJ, (QuantBucket(64, KERNEL),), DEQUANT),
            QuantOverride(Q8, HEAD, (QuantBucket(8, KERNEL),), DEQUANT),
        ),
    )
    assert table.select(Q4, QKV, 8) is KERNEL and table.select(Q4, QKV, 9) is DEQUANT
    assert table.select(Q4, OUT_PROJ, 64) is KERNEL and table.select(Q4, OUT_PROJ, 65) is DEQUANT
    assert table.select(Q8, HEAD, 8) is KERNEL and table.select(Q8, HEAD, 9) is DEQUANT  # above: dequant
    assert table.select(QType.Q6_K, (256, 256), 1) is KERNEL  # another kind: the sums' crossover


def test_the_sums_weigh_every_kind_measured_at_a_count():
    timings = [
        _timing(1, Q4, QKV, 1.0, 2.0),
        _timing(1, Q8, HEAD, 10.0, 3.0),  # the head outweighs q/k/v at 1 row: the sums say dequant
        _timing(8, Q4, QKV, 5.0, 4.0),
    ]
    assert derive_quant_table(timings).buckets == ()


def test_reasons_name_each_kind_its_crossover_and_the_counts_it_overrules():
    timings = [
        _timing(1, Q4, QKV, 1.0, 5.0),
        _timing(4, Q4, QKV, 6.0, 5.0),  # disturbed: kept on the kernel by the crossover
        _timing(8, Q4, QKV, 2.0, 8.0),
        _timing(64, Q4, QKV, 9.0, 6.0),
    ]
    assert explain_quant_table(timings) == [
        "Q4_1 32->64: kernel up to 8 rows",
        "  rows 1-1 (measured at 1): kernel 1.0 GFLOP/s; dequant 0.2 (0.20x)",
        "  rows 2-4 (measured at 4): dequant 0.2 GFLOP/s; kernel 0.2 (0.83x) -> kernel (the crossover)",
        "  rows 5-8 (measured at 8): kernel 0.5 GFLOP/s; dequant 0.1 (0.25x)",
        "  rows 9-64 (measured at 64): dequant 0.2 GFLOP/s; kernel 0.1 (0.67x)",
        "other kinds (all summed): kernel up to 8 rows",
        "  rows 1-1 (measured at 1): kernel 1.0 GFLOP/s; dequant 0.2 (0.20x)",
        "  rows 2-4 (measured at 4): dequant 0.2 GFLOP/s; kernel 0.2 (0.83x) -> kernel (the crossover)",
        "  rows 5-8 (measured at 8): kernel 0.5 GFLOP/s; dequant 0.1 (0.25x)",
        "  rows 9-64 (measured at 64): dequant 0.2 GFLOP/s; kernel 0.1 (0.67x)",
    ]


def test_no_timings_give_a_table_of_dequantise_only():
    assert derive_quant_table([]) == QuantTable(default=DEQUANT)


# -- a real measurement on tiny weights ---------------------------------------------------------------------


def test_every_kind_is_timed_at_every_row_count_on_each_available_path(monkeypatch):
    weights = model_quant_weights(QuantRuntime(), LINEAR)
    counts = RowCounts((1, 2), (8,))
    timings = time_quant_passes(weights, counts, max_rounds=2)
    expected = {KERNEL, DEQUANT} if quant_kernels() is not None else {DEQUANT}
    got = {(t.rows, t.name) for t in timings}
    kinds = ["Q4_1 32->64", "Q4_1 32->32"]
    assert got == {(r, k) for r in (1, 2, 8) for k in kinds} | {(1, "Q8_0 32->40"), (2, "Q8_0 32->40")}
    assert all(set(t.seconds) == expected and min(t.seconds.values()) > 0 for t in timings)
    qkv_at_2 = next(t for t in timings if t.rows == 2 and t.name == "Q4_1 32->64")
    assert qkv_at_2.flops == 2 * 2 * 64 * 32 * 2  # two layers' fused q/k/v at 2 rows
    monkeypatch.setattr(quant_calibrate, "quant_kernels", lambda: None)
    assert list(quant_calibrate.available_paths()) == [DEQUANT]
    assert math.isfinite(sum(t.seconds[DEQUANT] for t in timings))
