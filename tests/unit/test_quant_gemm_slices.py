"""quant_gemm_rows_f32: a slice of a GEMM's output columns, computed on the calling thread, has exactly the
bits quant_gemm_f32 gives those columns, wherever the slice starts and ends (decoder_layers.c splits every
GEMM of a decode step over its threads this way). Each build of the source is checked: the host's, AVX2 +
FMA and portable C.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
import torch

from pagedgen.ops.kernels import native
from pagedgen.ops.matmul.qweight import QType, QuantizedWeight
from tests.helpers.linear import random_weight

pytestmark = pytest.mark.cpu

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
# slices that tile 0 .. 45 off every group multiple (8 at one row, 4 above), one of one column; an empty one
BOUNDS = [(0, 13), (13, 14), (14, 37), (37, 45), (20, 20)]


class Slices:
    """``quant_gemm_f32`` and ``quant_gemm_rows_f32`` of one build."""

    def __init__(self, library: ctypes.CDLL):
        self.gemm = library.quant_gemm_f32
        self.gemm.argtypes = [_P, _I64, _P, _I64, ctypes.c_int, _I64, _I64, _P, _P, ctypes.c_int]
        self.rows = library.quant_gemm_rows_f32
        self.rows.argtypes = [_P, _I64, _P, _I64, ctypes.c_int, _I64, _I64, _I64, _P, _P, _I64, _P]
        self.floats = library.quant_gemm_buffer_floats
        self.floats.argtypes, self.floats.restype = [_I64, _I64], _I64

    def full(self, x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor) -> torch.Tensor:
        y = torch.empty(x.shape[0], w.shape[0])
        args = (x.data_ptr(), x.shape[0], w.data.data_ptr(), w.data.shape[1], w.kernel_id, w.shape[1])
        assert self.gemm(*args, w.shape[0], bias.data_ptr(), y.data_ptr(), 2) == 0
        return y

    def sliced(self, x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor) -> torch.Tensor:
        """Every column of the product, slice by slice (BOUNDS)."""
        y = torch.full((x.shape[0], w.shape[0]), float("nan"))
        buf = torch.zeros(self.floats(x.shape[0], w.shape[1]))
        args = (x.data_ptr(), x.shape[0], w.data.data_ptr(), w.data.shape[1], w.kernel_id, w.shape[1])
        for begin, end in BOUNDS:
            out = (bias.data_ptr(), y.data_ptr(), w.shape[0], buf.data_ptr())
            assert self.rows(*args, begin, end, *out) == 0
        return y


@pytest.fixture(scope="module", params=["host", "avx2", "portable"])
def slices(request, tmp_path_factory) -> Slices:
    library = native.native_library()
    if library is None:
        pytest.skip(native.native_status().detail)
    if request.param == "host":
        return Slices(library)
    flags = {"avx2": ["-O3", "-mavx2", "-mfma", "-mf16c"], "portable": ["-O3"]}[request.param]
    compiler = shutil.which("cc") or shutil.which("gcc")
    path = tmp_path_factory.mktemp("slices") / f"quant-{request.param}.so"
    sources = [str(source) for source in native.QUANT_SOURCES]
    cmd = [compiler, *flags, "-fopenmp", "-shared", "-fPIC", "-o", str(path), *sources]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    return Slices(ctypes.CDLL(str(path)))


@pytest.mark.parametrize("rows", [1, 2, 3, 5])
@pytest.mark.parametrize("qtype", list(QType), ids=lambda q: q.name)
def test_column_slices_have_the_whole_gemms_bits(slices, qtype, rows):
    k = 768 if qtype.block_elems == 256 else 576  # several chunks of the few-row path, a short last one
    weight = random_weight(qtype, 45, k, seed=11)
    gen = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, k, generator=gen), torch.randn(45, generator=gen)
    expected = slices.full(x, weight, bias)
    got = slices.sliced(x, weight, bias)
    np.testing.assert_array_equal(got.numpy().view(np.uint32), expected.numpy().view(np.uint32))


def test_an_unknown_qtype_is_refused_and_nothing_is_written(slices):
    y = torch.full((1, 8), 7.0)
    blocks = torch.zeros(8, 20, dtype=torch.uint8)
    x, buf = torch.zeros(1, 32), torch.zeros(slices.floats(1, 32))
    args = (x.data_ptr(), 1, blocks.data_ptr(), 20, 99, 32, 0, 8, None, y.data_ptr(), 8, buf.data_ptr())
    assert slices.rows(*args) == -1
    assert torch.equal(y, torch.full((1, 8), 7.0))
