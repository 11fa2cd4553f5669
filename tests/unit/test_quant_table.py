"""ops.matmul.quant_table and quant_gemm.use_quant_kernel: which path a quantized linear call takes, before
and after a table is installed, under pins, and that quantized_linear follows it."""

from __future__ import annotations

import pytest
import torch

import pagedgen.ops.matmul.quant_gemm as quant_gemm
from pagedgen.ops.matmul import quant_table
from pagedgen.ops.matmul.linear import linear
from pagedgen.ops.matmul.quant_gemm import quantized_linear, use_quant_kernel
from pagedgen.ops.matmul.quant_table import (
    DEQUANT_ONLY,
    KERNEL_ONLY,
    UNCALIBRATED,
    UNCALIBRATED_KERNEL_MAX_ROWS,
    QuantBucket,
    QuantOverride,
    QuantPath,
    QuantTable,
    adopt_quant_table,
    quant_table_pinned,
    set_quant_table,
    use_quant_table,
)
from pagedgen.ops.matmul.qweight import QType
from tests.helpers.linear import random_weight

pytestmark = pytest.mark.cpu  # the quantized CPU path choice

KERNEL, DEQUANT = QuantPath.KERNEL, QuantPath.DEQUANT
Q4, Q8 = QType.Q4_1, QType.Q8_0
# Q4_1 32 -> 8: the kernel up to 4 rows; Q8_0 32 -> 8: up to 16; any other kind: up to 2.
TABLE = QuantTable(
    buckets=(QuantBucket(2, KERNEL),),
    default=DEQUANT,
    overrides=(
        QuantOverride(Q4, (8, 32), (QuantBucket(4, KERNEL),), DEQUANT),
        QuantOverride(Q8, (8, 32), (QuantBucket(16, KERNEL),), DEQUANT),
    ),
)


@pytest.fixture(autouse=True)
def _uncalibrated():
    """Each test starts from the uncalibrated, unpinned table and leaves the process's table as it was."""
    with use_quant_table(quant_table.active_quant_table()):
        set_quant_table(UNCALIBRATED, pinned=False)
        yield


@pytest.fixture
def kernels_present(monkeypatch):
    """The decision alone: pretend the native kernels exist (use_quant_kernel only asks whether they do)."""
    monkeypatch.setattr(quant_gemm, "quant_kernels", lambda: object())


def test_a_table_selects_per_kind_then_falls_back_to_its_own_buckets():
    assert [TABLE.select(Q4, (8, 32), r) for r in (1, 4, 5)] == [KERNEL, KERNEL, DEQUANT]
    assert [TABLE.select(Q8, (8, 32), r) for r in (16, 17)] == [KERNEL, DEQUANT]
    assert [TABLE.select(Q4, (16, 32), r) for r in (2, 3)] == [KERNEL, DEQUANT]  # another shape
    assert [TABLE.select(QType.F16, (8, 32), r) for r in (2, 3)] == [KERNEL, DEQUANT]  # another format
    assert TABLE.describe() == (
        "rows<=2: kernel; else dequant; Q4_1 32->8: [<=4: kernel, else dequant]; "
        "Q8_0 32->8: [<=16: kernel, else dequant]"
    )


def test_a_malformed_table_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="QuantTable.buckets must be strictly ascending"):
        QuantTable(buckets=(QuantBucket(4, KERNEL), QuantBucket(2, DEQUANT)))
    with pytest.raises(ValueError, match="names a kind twice"):
        QuantTable(overrides=(QuantOverride(Q4, (8, 32), (), DEQUANT),) * 2)
    with pytest.raises(ValueError, match=r"QuantOverride\(Q4_1 32->8\).default must be a QuantPath"):
        QuantOverride(Q4, (8, 32), (), "dequant")
    with pytest.raises(ValueError, match="QuantBucket.max_rows must be a positive int"):
        QuantBucket(0, KERNEL)


def test_uncalibrated_the_kernel_runs_up_to_the_fallback_limit(kernels_present):
    weight = random_weight(Q4, 8, 32)
    assert use_quant_kernel(weight, 1) and use_quant_kernel(weight, UNCALIBRATED_KERNEL_MAX_ROWS)
    assert not use_quant_kernel(weight, UNCALIBRATED_KERNEL_MAX_ROWS + 1)


def test_an_installed_table_decides_per_kind_and_row_count(kernels_present):
    q4, q8, other = random_weight(Q4, 8, 32), random_weight(Q8, 8, 32), random_weight(Q4, 16, 32)
    assert use_quant_kernel(q4, 50)  # uncalibrated, memoised ...
    assert adopt_quant_table(TABLE)
    assert not use_quant_kernel(q4, 50)  # ... and the memo is dropped with the table
    assert [use_quant_kernel(q4, r) for r in (1, 4, 5)] == [True, True, False]
    assert [use_quant_kernel(q8, r) for r in (16, 17)] == [True, False]
    assert [use_quant_kernel(other, r) for r in (2, 3)] == [True, False]
    assert use_quant_kernel(q4.rows(0, 8), 4)  # a view of the same kind: same choice


def test_without_the_native_kernels_it_is_never_the_kernel(monkeypatch):
    monkeypatch.setattr(quant_gemm, "quant_kernels", lambda: None)
    set_quant_table(KERNEL_ONLY)
    assert not use_quant_kernel(random_weight(Q4, 8, 32), 1)


def test_a_pinned_table_stands_over_an_adopted_one(kernels_present):
    weight = random_weight(Q4, 8, 32)
    set_quant_table(DEQUANT_ONLY)  # pinned, as `bench throughput --gemm torch` does
    assert quant_table_pinned() and not adopt_quant_table(KERNEL_ONLY)
    assert not use_quant_kernel(weight, 1)
    with use_quant_table(KERNEL_ONLY):
        assert use_quant_kernel(weight, 10_000)
    assert quant_table_pinned() and quant_table.active_quant_table() is DEQUANT_ONLY


def test_set_quant_table_takes_only_a_quant_table():
    with pytest.raises(ValueError, match="set_quant_table takes a QuantTable, got str"):
        set_quant_table("kernel")


def test_quantized_linear_follows_the_table(monkeypatch, kernels_present):
    calls = []
    monkeypatch.setattr(quant_gemm, "quant_gemm", lambda x, w, b: calls.append(("kernel", x.shape[0])))
    monkeypatch.setattr(
        quant_gemm, "tiled_dequant_gemm", lambda x, w, b: calls.append(("dequant", x.shape[0]))
    )
    adopt_quant_table(TABLE)
    q4, other = random_weight(Q4, 8, 32), random_weight(Q4, 16, 32)
    for rows in (1, 4, 5):
        quantized_linear(torch.zeros(rows, 32), q4, None)
    linear(torch.zeros(3, 32), other)  # through the one linear entry point
    quantized_linear(torch.zeros(2, 1, 32), q4, None)  # not 2-D: the dequantise path takes any shape
    assert calls == [("kernel", 1), ("kernel", 4), ("dequant", 5), ("dequant", 3), ("dequant", 2)]
