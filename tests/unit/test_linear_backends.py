"""ops.matmul.linear / gemm: every backend computes F.linear's product; the table picks backends as stated.

Numerical contract: fp32, relative difference <= 1e-5 of the output scale vs ``F.linear`` (the backends only
differ in summation order). Selection is pure table arithmetic, checked at every bucket boundary.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedgen.ops.kernels.native import gemm_kernel, native_status
from pagedgen.ops.matmul import gemm
from pagedgen.ops.matmul.gemm import (
    NATIVE_ONLY,
    OPENBLAS_ONLY,
    TORCH_ONLY,
    UNTUNED,
    GemmBackend,
    GemmTable,
    RowBucket,
    ShapeOverride,
    choose_backend,
    gemm_step,
    openblas_eligible,
    use_gemm_table,
)
from pagedgen.ops.matmul.gemm_calibrate import (
    ShapeTiming,
    check_equivalence,
    derive_table,
    model_linear_shapes,
)
from pagedgen.ops.matmul.gemm_threads import (
    blas_num_threads,
    configure_cpu_threads,
    current_thread_settings,
    set_blas_num_threads,
    torch_pool,
)
from pagedgen.ops.matmul.linear import linear

pytestmark = pytest.mark.cpu  # the CPU GEMM backends (torch, OpenBLAS, native)

BLAS, TORCH, NATIVE = GemmBackend.OPENBLAS, GemmBackend.TORCH, GemmBackend.NATIVE
# Tables of the shape a calibration produces (the machine decides the boundaries; these are examples).
NATIVE_SMALL = GemmTable(buckets=(RowBucket(64, NATIVE),), default=TORCH)
OPENBLAS_SMALL = GemmTable(buckets=(RowBucket(16, BLAS),), default=TORCH)


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize(
    "table",
    [TORCH_ONLY, OPENBLAS_ONLY, NATIVE_ONLY, NATIVE_SMALL, OPENBLAS_SMALL],
    ids=["torch", "openblas", "native", "native-small", "openblas-small"],
)
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 64])
# (64, 7): the tiled kernel's leftover outputs; (100, 9): an input size the tile cannot take (portable loop)
@pytest.mark.parametrize("shape", [(576, 192), (96, 320), (64, 7), (100, 9)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_f_linear(table, rows, shape, with_bias):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, shape[0], generator=gen)
    w = torch.randn(shape[1], shape[0], generator=gen)
    b = torch.randn(shape[1], generator=gen) if with_bias else None
    expected = F.linear(x, w, b)
    with use_gemm_table(table), torch.inference_mode():
        got = linear(x, w, b)
    assert got.shape == (rows, shape[1]) and got.dtype == torch.float32
    assert _rel_diff(got, expected) <= 1e-5


def test_openblas_reads_strided_rows_without_changing_the_result():
    x = torch.randn(8, 2 * 64)[:, :64]  # row stride 128: a view numpy reads as is
    w = torch.randn(32, 64)
    with use_gemm_table(OPENBLAS_ONLY):
        got = linear(x, w)
    assert _rel_diff(got, F.linear(x, w)) <= 1e-5


@pytest.mark.parametrize(
    "x, w",
    [
        (torch.randn(2, 3, 8), torch.randn(4, 8)),  # 3-D input
        (torch.randn(2, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)),
        (torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(4, 8, dtype=torch.bfloat16)),
        (torch.randn(2, 8, requires_grad=True), torch.randn(4, 8)),
        (torch.randn(8, 2).t(), torch.randn(4, 8)),  # column-major input
    ],
    ids=["3d", "fp64", "bf16", "autograd", "column-major"],
)
def test_ineligible_calls_take_f_linear_exactly(x, w):
    assert not openblas_eligible(x, w, None)
    with use_gemm_table(OPENBLAS_ONLY):
        got = linear(x, w)
    assert torch.equal(got, F.linear(x, w))
    if x.requires_grad:
        got.sum().backward()  # the autograd graph is F.linear's
        assert x.grad is not None


def test_untuned_table_is_torch_everywhere():
    assert UNTUNED is TORCH_ONLY
    assert {UNTUNED.select(r, 576, 576) for r in (1, 16, 64, 4096)} == {TORCH}


def _native_or_skip():
    if gemm_kernel() is None:
        pytest.skip(native_status().detail)


def test_native_gemm_is_chosen_here_and_falls_back_to_torch_without_the_kernel(monkeypatch):
    _native_or_skip()
    with use_gemm_table(NATIVE_SMALL):
        assert choose_backend(4, 576, 576) is NATIVE
    monkeypatch.setattr(gemm, "gemm_kernel", lambda: None)
    with use_gemm_table(NATIVE_SMALL):  # a fresh memo: the fallback is decided per shape once
        assert choose_backend(4, 576, 576) is TORCH
        assert choose_backend(65, 576, 576) is TORCH
        x, w = torch.randn(4, 576), torch.randn(576, 576)
        assert _rel_diff(linear(x, w), F.linear(x, w)) <= 1e-5


def test_native_gemm_rows_are_batch_and_thread_invariant():
    """A row's output has the same bits alone, inside any batch, and on one or two threads."""
    _native_or_skip()
    gen = torch.Generator().manual_seed(5)
    x, w, b = torch.randn(16, 576, generator=gen), torch.randn(198, 576, generator=gen), torch.randn(198)
    with use_gemm_table(NATIVE_ONLY):
        batch = linear(x, w, b)
        alone = torch.cat([linear(x[i : i + 1], w, b) for i in range(16)])
        pairs = torch.cat([linear(x[i : i + 2], w, b) for i in range(0, 16, 2)])  # 2-row tiles
        assert torch.equal(batch, pairs)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            one_thread = linear(x, w, b)
        finally:
            torch.set_num_threads(threads)
    assert torch.equal(batch, alone) and torch.equal(batch, one_thread)


def test_native_gemm_reads_strided_rows():
    _native_or_skip()
    x = torch.randn(8, 2 * 64)[:, :64]  # row stride 128: copied to a contiguous block first
    w = torch.randn(32, 64)
    with use_gemm_table(NATIVE_ONLY):
        assert _rel_diff(linear(x, w), F.linear(x, w)) <= 1e-5


def test_table_buckets_and_overrides():
    table = GemmTable(
        buckets=(RowBucket(4, BLAS), RowBucket(32, TORCH), RowBucket(64, BLAS)),
        default=TORCH,
        overrides=(ShapeOverride(576, 49152, (RowBucket(1000, BLAS),)),),
    )
    assert [table.select(r, 576, 576) for r in (1, 4, 5, 32, 33, 64, 65)] == [
        BLAS,
        BLAS,
        TORCH,
        TORCH,
        BLAS,
        BLAS,
        TORCH,
    ]
    assert [table.select(r, 576, 49152) for r in (1, 500, 1000, 1001)] == [BLAS, BLAS, BLAS, TORCH]
    assert table.describe() == (
        "rows<=4: openblas; rows<=32: torch; rows<=64: openblas; else torch; "
        "576->49152: [<=1000: openblas, else torch]"
    )


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: GemmTable(buckets=(RowBucket(8, BLAS), RowBucket(4, TORCH))), "strictly ascending"),
        (lambda: GemmTable(buckets=(RowBucket(8, BLAS), RowBucket(8, TORCH))), "strictly ascending"),
        (lambda: RowBucket(0, BLAS), "max_rows must be a positive int"),
        (lambda: RowBucket(4, "openblas"), "backend must be a GemmBackend"),
        (
            lambda: GemmTable(
                overrides=(ShapeOverride(1, 2, ()), ShapeOverride(1, 2, (RowBucket(3, BLAS),)))
            ),
            "names a shape twice",
        ),
        (lambda: GemmTable(default="torch"), "default must be a GemmBackend"),
    ],
)
def test_table_validation_names_the_problem(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_set_table_returns_previous_and_scope_restores_on_error():
    before = gemm.active_table()
    with pytest.raises(RuntimeError), use_gemm_table(TORCH_ONLY):
        assert gemm.active_table() is TORCH_ONLY
        assert choose_backend(1, 576, 576) is TORCH
        raise RuntimeError("boom")
    assert gemm.active_table() is before
    previous = gemm.set_gemm_table(OPENBLAS_ONLY)
    try:
        assert previous is before and choose_backend(10_000, 8, 8) is BLAS
    finally:
        gemm.set_gemm_table(previous)
    with pytest.raises(ValueError, match="takes a GemmTable"):
        gemm.set_gemm_table("torch")


def test_gemm_step_uses_the_step_token_count_and_nests():
    with use_gemm_table(OPENBLAS_SMALL):
        assert choose_backend(1, 576, 49152) is BLAS
        with gemm_step(300):
            assert choose_backend(1, 576, 49152) is TORCH  # the LM head of a prefill step stays on torch
            with gemm_step(2):
                assert choose_backend(2, 576, 576) is BLAS
            assert choose_backend(1, 576, 576) is TORCH
        assert choose_backend(1, 576, 576) is BLAS
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="num_tokens must be a positive int"), gemm_step(bad):
            pass


def test_a_prefill_steps_few_row_head_takes_the_native_kernel_on_the_shared_pool():
    _native_or_skip()
    with use_gemm_table(NATIVE_SMALL), gemm_step(300):
        assert choose_backend(300, 576, 576) is TORCH
        assert choose_backend(4, 576, 49152) is NATIVE  # same OpenMP pool as torch: no hand-over


def test_openblas_parks_the_torch_pool_and_torch_restores_it():
    settings = current_thread_settings()
    configure_cpu_threads(2)
    try:
        x, w = torch.randn(2, 16), torch.randn(8, 16)
        with use_gemm_table(OPENBLAS_ONLY):
            linear(x, w)
        assert torch.get_num_threads() == 1 and torch_pool.parked
        assert current_thread_settings().torch_threads == 2  # the full count is still reported
        with use_gemm_table(TORCH_ONLY):
            linear(x, w)
        assert torch.get_num_threads() == 2 and not torch_pool.parked
    finally:
        torch_pool.restore()
        configure_cpu_threads(settings.torch_threads)


def test_blas_thread_count_round_trips():
    before = blas_num_threads()
    if before is None:
        pytest.skip("numpy's BLAS is not OpenBLAS here: its thread count cannot be set")
    try:
        assert set_blas_num_threads(1) and blas_num_threads() == 1
    finally:
        set_blas_num_threads(before)
    with pytest.raises(ValueError, match="positive int"):
        set_blas_num_threads(0)


def _timing(rows: int, torch_s: float, blas_s: float, shape=(8, 8)) -> ShapeTiming:
    return ShapeTiming(rows, shape[0], shape[1], {TORCH: torch_s, BLAS: blas_s})


def test_derive_table_sums_shapes_per_row_count_and_merges_buckets():
    timings = [
        _timing(1, 2.0, 1.0),
        _timing(1, 1.0, 1.5, (8, 16)),  # sum at 1 row: torch 3.0, openblas 2.5 -> openblas
        _timing(8, 3.0, 1.0),
        _timing(32, 1.0, 2.0),
        _timing(64, 1.0, 3.0),
        _timing(256, 5.0, 1.0),
    ]
    table = derive_table(timings)
    assert table == GemmTable(buckets=(RowBucket(8, BLAS), RowBucket(64, TORCH)), default=BLAS)
    t = timings[2]
    assert (
        t.fastest is BLAS
        and t.ratio(BLAS) == 3.0
        and t.gflops(TORCH) == pytest.approx(2 * 8 * 8 * 8 / 3.0 / 1e9)
    )


def test_model_linear_shapes_of_a_llama_config():
    class Config:
        hidden_size, head_dim, num_heads, num_kv_heads = 576, 64, 9, 3
        intermediate_size, vocab_size = 1536, 49152

    assert model_linear_shapes(Config()) == [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]


def test_backends_agree_on_a_model_shape():
    assert check_equivalence(4, 576, 1536) <= 1e-5
