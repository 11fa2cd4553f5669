"""ops.matmul.quant_gemm: weights kept as stored expand to exactly gguf-py's dequantised values, and every
GEMM path over them equals a float64 product of those values up to fp32 summation order.

Each kernel variant is built from the same source: the host's (-march=native: AVX-512 here), an AVX2 + FMA
build (the EPYC hosts) and a portable build without vector extensions (scalar f16 conversion included).
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import gguf
import numpy as np
import pytest
import torch

from pagedgen.ops.kernels import native
from pagedgen.ops.matmul.linear import linear
from pagedgen.ops.matmul.quant_gemm import (
    QuantKernels,
    dequantize,
    embedding,
    quant_gemm,
    quant_kernels,
    tiled_dequant_gemm,
)
from pagedgen.ops.matmul.quant_table import (
    DEQUANT_ONLY,
    KERNEL_ONLY,
    UNCALIBRATED,
    UNCALIBRATED_KERNEL_MAX_ROWS,
    use_quant_table,
)
from pagedgen.ops.matmul.qweight import QType, QuantizedWeight, concat_rows
from tests.helpers.linear import random_weight

pytestmark = pytest.mark.cpu  # the quantized GEMM kernels are native CPU code

ROWS = [1, 2, 3, 5, 16, 33, 64, 65, 200]
# in sizes of several blocks (K-quants: super-blocks of 256) and out sizes off every tile multiple
IN_FEATURES = {QType.Q4_K: 512, QType.Q6_K: 768, QType.F16: 160, QType.BF16: 72}  # BF16: AVX-512 tail
IN_FEATURES |= {QType.Q2_K: 256, QType.Q3_K: 768, QType.Q5_K: 512, QType.Q5_0: 160, QType.Q5_1: 64}
DEFAULT_IN = 96


def _in(qtype: QType) -> int:
    return IN_FEATURES.get(qtype, DEFAULT_IN)


def reference(weight: QuantizedWeight) -> np.ndarray:
    """gguf-py's dequantiser: the oracle every expanded weight must equal bit for bit."""
    data = weight.data.numpy()
    if weight.qtype is QType.BF16:
        return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    values = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[weight.qtype.name])
    return np.asarray(values, dtype=np.float32).reshape(weight.shape)


def assert_matches_float64(got: torch.Tensor, x: torch.Tensor, weight: QuantizedWeight, bias=None) -> None:
    """Within fp32 summation error of the float64 product of the dequantised weights."""
    w = torch.from_numpy(reference(weight)).double()
    ref = x.double() @ w.T + (0 if bias is None else bias.double())
    scale = x.double().abs() @ w.abs().T + (0 if bias is None else bias.double().abs())
    assert got.shape == ref.shape and got.dtype is torch.float32
    assert bool(((got.double() - ref).abs() <= 1e-5 * scale + 1e-30).all())


def _need_kernels():
    if quant_kernels() is None:
        pytest.skip(native.native_status().detail)


@pytest.fixture(scope="module", params=["host", "avx2", "portable"])
def kernels(request, tmp_path_factory) -> QuantKernels:
    """The kernel wrapper over one build of ``quant_gemm.c``."""
    _need_kernels()
    if request.param == "host":
        return quant_kernels()
    flags = {"avx2": ["-O3", "-mavx2", "-mfma", "-mf16c"], "portable": ["-O3"]}[request.param]
    compiler = shutil.which("cc") or shutil.which("gcc")
    path = tmp_path_factory.mktemp("kernels") / f"quant-{request.param}.so"
    sources = [str(source) for source in native.QUANT_SOURCES]  # q8: its flag's target
    cmd = [compiler, *flags, "-fopenmp", "-shared", "-fPIC", "-o", str(path), *sources]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    return QuantKernels(ctypes.CDLL(str(path)))


@pytest.mark.parametrize("qtype", list(QType), ids=lambda q: q.name)
def test_expanded_rows_are_bit_identical_to_gguf(kernels, qtype):
    weight = random_weight(qtype, 37, _in(qtype), seed=1)
    expected = reference(weight)
    got = kernels.dequantize(weight, None).numpy()
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))
    rows = torch.tensor([36, 0, 5, 5, 17], dtype=torch.int64)  # gathered (an embedding lookup), repeated
    got = kernels.dequantize(weight, rows).numpy()
    np.testing.assert_array_equal(got.view(np.uint32), expected[rows.numpy()].view(np.uint32))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("qtype", list(QType), ids=lambda q: q.name)
def test_kernel_matches_the_dequantized_reference(kernels, qtype, rows):
    k = _in(qtype)
    gen = torch.Generator().manual_seed(rows)
    for out in (1, 6, 37):  # below, off and across the 4-row groups
        weight = random_weight(qtype, out, k, seed=out)
        x = torch.randn(rows, k, generator=gen)
        bias = torch.randn(out, generator=gen)
        assert_matches_float64(kernels.gemm(x, weight, None), x, weight)
        assert_matches_float64(kernels.gemm(x, weight, bias), x, weight, bias)


LIMIT = UNCALIBRATED_KERNEL_MAX_ROWS
TABLES = {"uncalibrated": UNCALIBRATED, "kernel": KERNEL_ONLY, "dequant": DEQUANT_ONLY}


@pytest.mark.parametrize("rows", [1, LIMIT, LIMIT + 1, 200])
@pytest.mark.parametrize("table", list(TABLES))
@pytest.mark.parametrize("qtype", list(QType), ids=lambda q: q.name)
def test_linear_dispatch_matches_the_reference_on_either_path(qtype, table, rows):
    _need_kernels()
    weight = random_weight(qtype, 37, _in(qtype), seed=3)
    gen = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, _in(qtype), generator=gen), torch.randn(37, generator=gen)
    with use_quant_table(TABLES[table]):
        assert_matches_float64(linear(x, weight, bias), x, weight, bias)
    assert_matches_float64(quant_gemm(x, weight, bias), x, weight, bias)


def test_many_rows_go_tile_by_tile_over_a_large_weight(monkeypatch):
    _need_kernels()
    import pagedgen.ops.matmul.quant_gemm as quant_gemm_module

    monkeypatch.setattr(quant_gemm_module, "TILE_BYTES", 4 * 96 * 10)  # tiles of 10 rows: 37 = 3 x 10 + 7
    weight = random_weight(QType.Q8_0, 37, 96, seed=4)
    x, bias = torch.randn(70, 96), torch.randn(37)
    assert_matches_float64(tiled_dequant_gemm(x, weight, bias), x, weight, bias)


@pytest.mark.parametrize("batch_rows", [16, 32])  # 32: a 32-stream decode step (ten full 3-row tiles and a 2)
@pytest.mark.parametrize(
    "qtype",
    [QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.BF16],
    ids=lambda q: q.name,
)
def test_a_rows_output_bits_do_not_depend_on_the_batch_or_the_thread_count(kernels, qtype, batch_rows):
    k = _in(qtype)
    weight = random_weight(qtype, 75, k, seed=5)
    x, bias = torch.randn(batch_rows, k, generator=torch.Generator().manual_seed(5)), torch.randn(75)
    batch = kernels.gemm(x, weight, bias)
    assert_matches_float64(batch, x, weight, bias)
    alone = torch.cat([kernels.gemm(x[i : i + 1], weight, bias) for i in range(batch_rows)])
    pairs = torch.cat([kernels.gemm(x[i : i + 2], weight, bias) for i in range(0, batch_rows, 2)])
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        other_threads = kernels.gemm(x, weight, bias)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batch, alone) and torch.equal(batch, pairs) and torch.equal(batch, other_threads)


@pytest.mark.parametrize("qtype", list(QType), ids=lambda q: q.name)
def test_the_few_row_paths_give_the_whole_row_paths_bits(kernels, qtype):
    """1-3 rows take the chunked (or, for some formats at 1 row, the register-direct) path, 4+ rows the
    whole-row buffer: across several chunks and a short last one (k = 576 = 256 + 256 + 64; K-quants 768)
    and a short last row group, every row's bits are the same on either side of that boundary."""
    k = 768 if qtype.block_elems == 256 else 576
    weight = random_weight(qtype, 45, k, seed=8)
    x, bias = torch.randn(7, k, generator=torch.Generator().manual_seed(8)), torch.randn(45)
    batch = kernels.gemm(x, weight, bias)  # 7 rows: the whole-row path
    assert_matches_float64(batch, x, weight, bias)
    for rows in (1, 2, 3):
        for start in range(0, 7 - rows + 1):
            part = slice(start, start + rows)
            assert torch.equal(kernels.gemm(x[part], weight, bias), batch[part])


# the formats with a 1-row register path on AVX2 and AVX-512 (quant_gemm.c's direct_1x8; and Q8_0's
# direct_q8_0_1x4, groups of 4, the head's path at batch 1)
REGISTER_PATHS = [
    QType.Q4_0,
    QType.Q4_1,
    QType.Q5_0,
    QType.Q5_1,
    QType.Q4_K,
    QType.Q5_K,
    QType.Q6_K,
    QType.Q8_0,
]


@pytest.mark.parametrize("qtype", REGISTER_PATHS, ids=lambda q: q.name)
def test_the_one_row_register_paths_give_the_whole_row_paths_bits_on_every_group_shape(kernels, qtype):
    """One row against 1-17 weight rows (short groups of 8 or 4, whose unused rows alias the first) and over
    several blocks and super-blocks, zero scales and zero weights included (the sign of a zero product is
    the expander's): the same bits as the same row inside a 5-row batch (the whole-row path)."""
    k = 512 if qtype.block_elems == 256 else 160
    for out in (1, 7, 8, 9, 17):
        weight = random_weight(qtype, out, k, seed=20 + out)
        blocks = weight.data.view(out, -1, qtype.block_bytes)
        blocks[0, 0] = 0  # a block of zeros: zero scales (and mins), zero quants
        x = torch.randn(5, k, generator=torch.Generator().manual_seed(out))
        x[:, :32] = -x[:, :32].abs()  # negative activations against zero weights: -0 products
        batch = kernels.gemm(x, weight, None)
        assert_matches_float64(batch, x, weight)
        for row in range(5):
            assert torch.equal(kernels.gemm(x[row : row + 1], weight, None), batch[row : row + 1])


def test_embedding_dequantizes_the_looked_up_rows():
    weight = random_weight(QType.Q8_0, 50, 64, seed=6)
    ids = torch.tensor([[3, 49], [0, 3]])
    got = embedding(ids, weight)  # [2, 2, 64]
    expected = torch.from_numpy(reference(weight))[ids]
    assert torch.equal(got, expected)
    with pytest.raises(IndexError, match="outside"):
        embedding(torch.tensor([50]), weight)


@pytest.mark.parametrize("count", [1, 64, 65, 300])  # up to 64 ids are read as a list, more by reductions
def test_a_looked_up_id_outside_the_vocabulary_is_refused_on_either_check(count):
    weight = random_weight(QType.Q8_0, 50, 64, seed=6)
    ids = torch.arange(count) % 50
    assert torch.equal(embedding(ids, weight), torch.from_numpy(reference(weight))[ids])
    for bad in (50, -1):
        wrong = ids.clone()
        wrong[count // 2] = bad
        with pytest.raises(IndexError, match="outside"):
            embedding(wrong, weight)
    assert embedding(torch.tensor([], dtype=torch.int64), weight).shape == (0, 64)


def test_dequantize_without_the_kernels_uses_gguf(monkeypatch):
    import pagedgen.ops.matmul.quant_gemm as quant_gemm_module

    monkeypatch.setattr(quant_gemm_module, "quant_kernels", lambda: None)
    for qtype in (QType.Q4_1, QType.F16, QType.BF16):
        weight = random_weight(qtype, 9, _in(qtype), seed=7)
        np.testing.assert_array_equal(dequantize(weight).numpy(), reference(weight))
        x = torch.randn(2, _in(qtype))
        assert_matches_float64(linear(x, weight), x, weight)  # the dequantise + torch path


def test_fusing_rows_is_concatenating_blocks():
    parts = [random_weight(QType.Q4_1, n, 64, seed=n) for n in (8, 4, 4)]
    fused = concat_rows(parts)
    assert fused.shape == (16, 64)
    assert torch.equal(fused.rows(8, 12).data, parts[1].data)
    np.testing.assert_array_equal(reference(fused), np.concatenate([reference(p) for p in parts]))
    with pytest.raises(ValueError, match="qtype or in size differ"):
        concat_rows([parts[0], random_weight(QType.Q8_0, 4, 64)])


def test_parts_back_to_back_in_one_storage_are_stacked_as_a_view():
    whole = random_weight(QType.Q5_0, 16, 64, seed=9)
    parts = [whole.rows(0, 8), whole.rows(8, 12), whole.rows(12, 16)]
    fused = concat_rows(parts)
    assert fused.data.data_ptr() == whole.data.data_ptr() and torch.equal(fused.data, whole.data)  # no copy
    gapped = concat_rows([whole.rows(0, 8), whole.rows(12, 16)])  # not adjacent: copied
    assert gapped.data.data_ptr() != whole.data.data_ptr()
    assert torch.equal(gapped.data, torch.cat([whole.data[:8], whole.data[12:]]))
    swapped = concat_rows([whole.rows(8, 16), whole.rows(0, 8)])
    assert torch.equal(swapped.data, torch.cat([whole.data[8:], whole.data[:8]]))


def test_a_malformed_weight_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="not a multiple of Q4_1 blocks"):
        QuantizedWeight(QType.Q4_1, (2, 48), torch.zeros(2, 30, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"QuantizedWeight.data must be uint8 \(2, 40\)"):
        QuantizedWeight(QType.Q4_1, (2, 64), torch.zeros(2, 41, dtype=torch.uint8))
