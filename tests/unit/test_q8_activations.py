"""activations="q8": llama.cpp-style 8-bit activations with integer dot products (kernels/quant_q8.c).

The kernel is integer arithmetic plus a few fp32 operations per block, so a numpy rebuild of the same steps
(quantize_row_q8_0/q8_1 as llama.cpp's reference code writes them, the int32 block sums, then the fp32
scale and accumulation in block order) must equal it bit for bit, in every build: the host's
(-march=native: VNNI dpbusd where the CPU has it), AVX2 maddubs, and portable C (software f16 rounding).
The model option is opt-in, flags only the formats with a kernel, and is refused where no kernel runs.
"""

from __future__ import annotations

import ctypes
import dataclasses
import shutil
import subprocess

import gguf
import numpy as np
import pytest
import torch

from pagedgen.errors import ModelLoadError
from pagedgen.models.model import Model
from pagedgen.ops.kernels import native
from pagedgen.ops.kernels.cpu_info import cpu_features
from pagedgen.ops.matmul.quant_gemm import QuantKernels, quant_kernels
from pagedgen.ops.matmul.qweight import Q8_ACTIVATION_TYPES, QType, QuantizedWeight
from tests.helpers.linear import PROMPT_IDS, all_logits, random_weight
from tests.model.tiny_checkpoints import TINY_RAW, random_state, write_gguf

pytestmark = pytest.mark.cpu  # native CPU kernels

K_TYPES = (QType.Q4_K, QType.Q5_K, QType.Q6_K)  # against 256-element activation blocks (quant_q8_k.c)
Q8_TYPES = sorted(Q8_ACTIVATION_TYPES - set(K_TYPES), key=lambda q: q.ggml_id)  # 32-element blocks
_F32 = np.float32


def _need_kernels():
    if quant_kernels() is None:
        pytest.skip(native.native_status().detail)


def _build(tmp_path_factory, name: str, flags: list[str]) -> ctypes.CDLL:
    compiler = shutil.which("cc") or shutil.which("gcc")
    path = tmp_path_factory.mktemp("kernels") / f"q8-{name}.so"
    sources = [str(source) for source in native.QUANT_SOURCES]
    cmd = [compiler, *flags, "-fopenmp", "-shared", "-fPIC", "-o", str(path), *sources]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    return ctypes.CDLL(str(path))


AVX2_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c"]
# the 512-bit one-row body (its integer sums of unsigned bytes, the offsets taken back out)
AVX512_FLAGS = [*AVX2_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]
AVX512_FEATURES = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}


@pytest.fixture(scope="module", params=["host", "avx2", "avx512", "portable"])
def library(request, tmp_path_factory) -> ctypes.CDLL:
    _need_kernels()
    if request.param == "host":
        return native.native_library()
    if request.param == "avx2" and not {"avx2", "fma", "f16c"} <= set(cpu_features()):
        pytest.skip("this CPU has no AVX2 + FMA + F16C")
    if request.param == "avx512" and not set(cpu_features()) >= AVX512_FEATURES:
        pytest.skip("this CPU has no AVX-512 VNNI")
    flags = {"avx2": AVX2_FLAGS, "avx512": AVX512_FLAGS, "portable": ["-O3"]}[request.param]
    return _build(tmp_path_factory, request.param, flags)


def _q8(weight: QuantizedWeight) -> QuantizedWeight:
    return dataclasses.replace(weight, q8_activations=True)


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """llama.cpp's quantize_row_q8_1 reference per 32-block: int q, f16-rounded d and d * sum(q)."""
    blocks = x.reshape(x.shape[0], -1, 32).astype(_F32)  # [m, nb, 32]
    d = np.abs(blocks).max(-1) / _F32(127)
    with np.errstate(divide="ignore"):
        inverse = np.where(d != 0, _F32(1) / d, _F32(0)).astype(_F32)
    scaled = (blocks * inverse[..., None]).astype(np.float64)  # fp32 products, held exactly
    q = (np.sign(scaled) * np.floor(np.abs(scaled) + 0.5)).astype(np.int64)  # roundf: half away from 0
    sums = (q.sum(-1).astype(_F32) * d).astype(_F32)
    return q, d.astype(np.float16).astype(_F32), sums.astype(np.float16).astype(_F32)


def block_ints(weight: QuantizedWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Each block's 32 integers (signed formats offset), its f16 scale and its f16 min (affine formats)."""
    qtype = weight.qtype
    raw = weight.data.numpy().reshape(weight.shape[0], -1, qtype.block_bytes)  # [n, nb, bytes]
    scale = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(_F32)
    if qtype is QType.Q8_0:
        return raw[..., 2:34].view(np.int8).astype(np.int64), scale, None
    affine = qtype in (QType.Q4_1, QType.Q5_1)
    five = qtype in (QType.Q5_0, QType.Q5_1)
    start = (4 if affine else 2) + (4 if five else 0)
    qs = raw[..., start : start + 16].astype(np.int64)
    ints = np.concatenate([qs & 15, qs >> 4], axis=-1)
    if five:
        high = raw[..., start - 4 : start].copy().view(np.uint32)[..., 0].astype(np.int64)
        ints |= ((high[..., None] >> np.arange(32)) & 1) << 4
    minimum = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(_F32) if affine else None
    offset = 0 if affine else 16 if five else 8
    return ints - offset, scale, minimum


def reference(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> np.ndarray:
    q, dx, sx = quantize_rows(x.numpy())
    w, dw, mw = block_ints(weight)
    isum = np.einsum("mbj,nbj->mnb", q, w)  # exact int64 (int32 range)
    acc = np.zeros((x.shape[0], weight.shape[0]), dtype=_F32)
    for b in range(q.shape[1]):
        t = isum[..., b].astype(_F32) * (dw[None, :, b] * dx[:, b, None])
        if mw is not None:
            t = t + mw[None, :, b] * sx[:, b, None]
        acc = acc + t
    return acc if bias is None else acc + bias.numpy()


def _x(rows: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    x[0, :32] = 0.0  # a block of zeros: d = 0, inverse 0
    if rows > 1:
        x[1, 32:64] *= 300.0  # a wide range (d * sum(q) still within f16)
        x[1, 64:96] *= 1e-6  # tiny activations: f16 subnormal scales
    return x


def _weight(qtype: QType, out: int, k: int, seed: int) -> QuantizedWeight:
    weight = random_weight(qtype, out, k, seed=seed)
    if qtype is QType.Q8_0:  # -128, which gguf's quantiser never writes, is a valid stored value
        data = weight.data.clone()
        data[3, 2:34] = 0x80
        weight = QuantizedWeight(qtype, weight.shape, data)
    return weight


@pytest.mark.parametrize("rows", [1, 2, 9, 32, 70, 140])
@pytest.mark.parametrize("qtype", Q8_TYPES, ids=lambda q: q.name)
def test_the_q8_kernel_is_the_integer_arithmetic_exactly(library, qtype, rows):
    """One row takes the one-row kernel, more rows a many-row one (each block widened once for all of
    them; AVX2: 70 rows are two passes of at most 64; AVX-512: from 8 rows on, x rows in panels of 16, full
    ones at 32 rows, else a short last one, 140 rows two passes of at most 128), and each equals the integer
    reference bit for bit."""
    kernels = QuantKernels(library)
    # 8-row groups with a short last one; several blocks; more blocks than Q8_0's by-rows chunk of 32
    for out, k in ((37, 96), (21, 576), (11, 1088)):
        weight, x = _weight(qtype, out, k, seed=out), _x(rows, k, seed=rows)
        bias = torch.randn(out, generator=torch.Generator().manual_seed(out))
        np.testing.assert_array_equal(kernels.gemm(x, _q8(weight), None).numpy(), reference(x, weight, None))
        np.testing.assert_array_equal(kernels.gemm(x, _q8(weight), bias).numpy(), reference(x, weight, bias))


def _column_slices(library: ctypes.CDLL, x: torch.Tensor, weight: QuantizedWeight, bias, cuts) -> np.ndarray:
    """quant_gemm_q8_rows over the outputs cut at ``cuts``, one call per slice, into one [m, n + 3] buffer
    (a row stride wider than n); x rounded once by quant_q8_quantize, as decoder_layers.c does."""
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    library.quant_q8_buffer_bytes.restype = i64
    library.quant_q8_buffer_bytes.argtypes = [i64, i64]
    library.quant_q8_quantize.argtypes = [p, i64, i64, p]
    library.quant_gemm_q8_rows.argtypes = [p, i64, p, i64, ctypes.c_int, i64, i64, i64, p, p, i64]
    m, k = x.shape
    n = weight.shape[0]
    buf = np.zeros(library.quant_q8_buffer_bytes(m, k) // 4 + 1, dtype=_F32)
    assert library.quant_q8_quantize(x.data_ptr(), m, k, buf.ctypes.data) == 0
    y = np.full((m, n + 3), np.nan, dtype=_F32)
    bias_ptr = None if bias is None else bias.data_ptr()
    bounds = [0, *cuts, n]
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        failed = library.quant_gemm_q8_rows(
            buf.ctypes.data,
            m,
            weight.data.data_ptr(),
            weight.data.shape[1],
            weight.qtype.ggml_id,
            k,
            lo,
            hi,
            bias_ptr,
            y.ctypes.data,
            n + 3,
        )
        assert failed == 0
    assert np.isnan(y[:, n:]).all()  # nothing written past the slices
    return y[:, :n]


@pytest.mark.parametrize("rows", [1, 3, 20])
@pytest.mark.parametrize("qtype", [*Q8_TYPES, *K_TYPES], ids=lambda q: q.name)
def test_column_slices_of_the_q8_kernel_have_its_bits(library, qtype, rows):
    """decoder_layers.c splits each GEMM's outputs over its threads at any row, multiple of 8 or not:
    every split gives the whole kernel's bits, with and without a bias (one x row: the one-row body, its
    odd last block too; three: the many-row one; 20: AVX-512's panels, a short second one; the K-quants
    against their 256-blocks)."""
    if qtype in K_TYPES:
        weight, x, rebuild = random_weight(qtype, 37, 512, seed=4), _x_k(rows, 512, seed=4), reference_k
    else:
        weight, x, rebuild = _weight(qtype, 37, 96, seed=4), _x(rows, 96, seed=4), reference
    bias = torch.randn(37, generator=torch.Generator().manual_seed(4))
    for b in (None, bias):
        whole = rebuild(x, weight, b)
        for cuts in ([], [8, 16, 24, 32], [5, 13], [1, 36]):
            np.testing.assert_array_equal(_column_slices(library, x, weight, b, cuts), whole)


# ---- the K-quants against 256-element activation blocks (quant_q8_k.c) ----


def quantize_rows_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """llama.cpp's quantize_row_q8_K_ref per 256-block: q (the x of largest |x| scaled to -127, rint: half to
    even, at most 127), d = 1 / iscale, and the sums of q per 16 and per 32."""
    m = x.shape[0]
    blocks = x.reshape(m, -1, 256).astype(_F32)
    first_max = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)[..., 0]
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(first_max != 0, _F32(-127) / first_max, _F32(0)).astype(_F32)
        d = np.where(first_max != 0, _F32(1) / iscale, _F32(0)).astype(_F32)
    q = np.minimum(np.rint((blocks * iscale[..., None]).astype(_F32)), 127).astype(np.int64)
    return q, d, q.reshape(m, -1, 16, 16).sum(-1), q.reshape(m, -1, 8, 32).sum(-1)


def _scales_mins_k4(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's get_scale_min_k4 over a block's 12 bytes: eight 6-bit scales and eight 6-bit mins."""
    q = packed.astype(np.int64)
    scales = np.concatenate([q[..., 0:4] & 63, (q[..., 8:12] & 15) | ((q[..., 0:4] >> 6) << 4)], -1)
    mins = np.concatenate([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], -1)
    return scales, mins


def k_block_ints(weight: QuantizedWeight):
    """Each 256-block's unsigned quants u, each element's integer scale c, the eight mins (Q4_K / Q5_K, else
    None), d and dmin (0 for Q6_K): the weight is d * c * u - dmin * min, Q6_K's d * c * (u - 32)."""
    qtype = weight.qtype
    raw = weight.data.numpy().reshape(weight.shape[0], -1, qtype.block_bytes)
    u = np.zeros(raw.shape[:2] + (256,), dtype=np.int64)
    if qtype is QType.Q6_K:
        ql, qh = raw[..., :128].astype(np.int64), raw[..., 128:192].astype(np.int64)
        for half in range(2):
            lo, hi = ql[..., 64 * half : 64 * half + 64], qh[..., 32 * half : 32 * half + 32]
            base = 128 * half
            u[..., base : base + 32] = (lo[..., :32] & 15) | (hi & 3) << 4
            u[..., base + 32 : base + 64] = (lo[..., 32:] & 15) | ((hi >> 2) & 3) << 4
            u[..., base + 64 : base + 96] = (lo[..., :32] >> 4) | ((hi >> 4) & 3) << 4
            u[..., base + 96 : base + 128] = (lo[..., 32:] >> 4) | ((hi >> 6) & 3) << 4
        scales = raw[..., 192:208].copy().view(np.int8).astype(np.int64)
        d = raw[..., 208:210].copy().view(np.float16)[..., 0].astype(_F32)
        return u, np.repeat(scales, 16, -1), None, d, np.zeros_like(d)
    scales, mins = _scales_mins_k4(raw[..., 4:16])
    five = qtype is QType.Q5_K
    qs = raw[..., 48:176] if five else raw[..., 16:144]
    qh = raw[..., 16:48].astype(np.int64)
    for c in range(4):
        byte = qs[..., 32 * c : 32 * c + 32].astype(np.int64)
        u[..., 64 * c : 64 * c + 32] = (byte & 15) | ((((qh >> (2 * c)) & 1) << 4) if five else 0)
        u[..., 64 * c + 32 : 64 * c + 64] = (byte >> 4) | ((((qh >> (2 * c + 1)) & 1) << 4) if five else 0)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(_F32)
    dmin = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(_F32)
    return u, np.repeat(scales, 32, -1), mins, d, dmin


def reference_k(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> np.ndarray:
    """quant_q8_k.c's arithmetic: eight int32 lanes per block (lane i: bytes 4i .. 4i + 3 of each 32), Q6_K's
    offset out in integers, the fp32 lanes L (and M for the mins) in block order, then the fixed sums."""
    q, dx, b16, b32 = quantize_rows_k(x.numpy())
    u, c, mins, dw, dmin = k_block_ints(weight)
    m, (n, nsb) = q.shape[0], u.shape[:2]
    lanes = np.einsum("nbvil,mbvil->mnbi", (c * u).reshape(n, nsb, 8, 8, 4), q.reshape(m, nsb, 8, 8, 4))
    if weight.qtype is QType.Q6_K:
        sc = c[..., ::16].reshape(n, nsb, 8, 2)
        lanes = lanes - 32 * np.einsum("nbip,mbip->mnbi", sc, b16.reshape(m, nsb, 8, 2))
    else:
        minima = np.einsum("nbip,mbip->mnbi", mins.reshape(n, nsb, 4, 2), b32.reshape(m, nsb, 4, 2))
    assert np.abs(lanes).max() < 2**31
    L, M = np.zeros((m, n, 8), dtype=_F32), np.zeros((m, n, 4), dtype=_F32)
    for b in range(nsb):
        L = L + lanes[:, :, b].astype(_F32) * (dw[None, :, b] * dx[:, b, None])[..., None]
        if mins is not None:
            M = M + minima[:, :, b].astype(_F32) * (dmin[None, :, b] * dx[:, b, None])[..., None]
    half = L[..., :4] + L[..., 4:]
    y = (half[..., 0] + half[..., 2]) + (half[..., 1] + half[..., 3])
    if mins is not None:
        y = y - ((M[..., 0] + M[..., 2]) + (M[..., 1] + M[..., 3]))
    return y if bias is None else y + bias.numpy()


def _x_k(rows: int, k: int, seed: int) -> torch.Tensor:
    x = _x(rows, k, seed)
    x[0, 256:512] = 0.0  # a whole 256-block of zeros: d = 0
    if rows > 1 and k >= 512:  # block 1 of row 1: scale -1 exactly, so ties to round
        x[1, 256:512].clamp_(-100.0, 100.0)
        x[1, 256], x[1, 263] = -127.0, 127.0  # two of the largest |x|: the first one's sign sets the scale's
        x[1, 257:261] = torch.tensor([2.5, -3.5, 0.5, 126.5])  # ties: half to even (2, -4, 0, 126 negated)
    return x


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_the_k_quant_reference_reads_the_blocks_as_gguf_does(qtype):
    """The numpy rebuild's reading of the K-quant blocks (quants, scales, mins) dequantises to what gguf's own
    dequantiser gives, so the kernel is checked against the format, not against itself."""
    weight = random_weight(qtype, 9, 512, seed=7)
    u, c, mins, d, dmin = k_block_ints(weight)
    offset = 32 if qtype is QType.Q6_K else 0
    values = d[..., None] * (c * (u - offset)).astype(_F32)
    if mins is not None:
        values = values - (dmin[..., None] * np.repeat(mins, 32, -1).astype(_F32))
    expected = gguf.quants.dequantize(weight.data.numpy(), gguf.GGMLQuantizationType[qtype.name])
    np.testing.assert_allclose(values.reshape(9, 512), expected, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("rows", [1, 2, 9, 70])
@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_the_k_quant_q8_kernel_is_the_integer_arithmetic_exactly(library, qtype, rows):
    """Q4_K, Q5_K and Q6_K against 256-element activation blocks: every build equals the integer reference
    bit for bit, at one x row and at several (each block widened once for all of them; 70 rows are two
    passes of at most 64), with and without a bias, including a block of zero activations."""
    kernels = QuantKernels(library)
    for out, k in ((37, 512), (21, 1536), (11, 256)):
        weight, x = random_weight(qtype, out, k, seed=out), _x_k(rows, k, seed=rows)
        bias = torch.randn(out, generator=torch.Generator().manual_seed(out))
        np.testing.assert_array_equal(
            kernels.gemm(x, _q8(weight), None).numpy(), reference_k(x, weight, None)
        )
        np.testing.assert_array_equal(
            kernels.gemm(x, _q8(weight), bias).numpy(), reference_k(x, weight, bias)
        )


def test_the_k_quant_q8_kernel_is_close_to_the_exact_one():
    """Rounding activations to 8 bits moves each output by a little of its range, no more: the integer path
    computes the weights' model (a wrong scale or nibble order would be far off)."""
    _need_kernels()
    kernels = quant_kernels()
    for qtype in K_TYPES:
        weight, x = random_weight(qtype, 64, 1024, seed=2), _x_k(4, 1024, seed=2)
        exact, fast = kernels.gemm(x, weight, None), kernels.gemm(x, _q8(weight), None)
        assert float((exact - fast).abs().max()) <= 0.02 * float(exact.abs().max()), qtype.name


def test_the_q8_slice_entry_refuses_what_has_no_kernel(library):
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    library.quant_gemm_q8_rows.argtypes = [p, i64, p, i64, ctypes.c_int, i64, i64, i64, p, p, i64]
    library.quant_q8_quantize.argtypes = [p, i64, i64, p]
    check = library.quant_gemm_q8_rows
    assert check(None, 1, None, 0, QType.Q3_K.ggml_id, 256, 0, 0, None, None, 0) == -1  # no q8 kernel
    assert check(None, 1, None, 0, QType.Q4_K.ggml_id, 96, 0, 0, None, None, 0) == -1  # not 256-blocks
    assert check(None, 1, None, 0, QType.Q6_K.ggml_id, 512, 0, 0, None, None, 0) == 0
    assert (
        check(None, 1, None, 0, QType.Q4_1.ggml_id, 48, 0, 0, None, None, 0) == -1
    )  # k not a multiple of 32
    assert check(None, 1, None, 0, QType.Q4_1.ggml_id, 64, 0, 0, None, None, 0) == 0
    assert library.quant_q8_quantize(None, 1, 48, None) == -1


@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q8_0, QType.Q4_K, QType.Q6_K], ids=lambda q: q.name)
def test_a_q8_rows_bits_do_not_depend_on_the_batch_or_the_thread_count(qtype):
    _need_kernels()
    kernels = quant_kernels()
    weight, x = _q8(_weight(qtype, 75, 768, seed=5)), _x(6, 768, seed=5)
    batch = kernels.gemm(x, weight, None)
    alone = torch.cat([kernels.gemm(x[i : i + 1], weight, None) for i in range(6)])
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        other_threads = kernels.gemm(x, weight, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batch, alone) and torch.equal(batch, other_threads)


def test_the_host_build_uses_the_widest_integer_dot_product():
    _need_kernels()
    variant = native.native_library().quant_q8_variant
    variant.restype = ctypes.c_int
    features = set(cpu_features())
    vnni = {"avx512_vnni", "avx512vl"} <= features or "avx_vnni" in features
    expected = 2 if vnni and {"avx2", "f16c"} <= features else 1 if {"avx2", "f16c"} <= features else 0
    if features >= AVX512_FEATURES:
        expected = 3
    assert variant() == expected


def test_only_formats_with_a_kernel_take_the_flag():
    with pytest.raises(ValueError, match="Q3_K has no 8-bit-activation kernel"):
        _q8(random_weight(QType.Q3_K, 8, 256))
    weight = _q8(random_weight(QType.Q4_1, 8, 64))
    assert weight.kernel_id == QType.Q4_1.ggml_id | 0x100 and weight.rows(2, 5).q8_activations


# ---- the model option ----


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDGEN_CACHE_DIR", str(tmp_path / "cache"))


def _gguf(tmp_path, qtype: gguf.GGMLQuantizationType):
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_gguf(path, "llama", random_state(TINY_RAW, seed=3), TINY_RAW, qtype=qtype, tokenizer=False)
    return path


def _weights(model: Model) -> list[QuantizedWeight]:
    found = []
    for module in model.runtime.modules():
        for value in vars(module).values():
            if isinstance(value, QuantizedWeight):
                found.append(value)
    return found


def test_q8_activations_flag_the_quantised_weights_and_change_the_logits_a_little(tmp_path):
    _need_kernels()

    path = str(_gguf(tmp_path, gguf.GGMLQuantizationType.Q8_0))
    exact, fast = Model(path, device="cpu"), Model(path, device="cpu", activations="q8")
    assert exact.activations == "fp32" and fast.activations == "q8"
    assert _weights(fast) and all(w.q8_activations for w in _weights(fast))
    assert not any(w.q8_activations for w in _weights(exact))
    a, b = all_logits(exact, PROMPT_IDS), all_logits(fast, PROMPT_IDS)
    assert not torch.equal(a, b)  # the 8-bit path ran
    assert float((a - b).abs().max()) <= 0.05 * float(a.abs().max())


def test_q8_activations_are_refused_where_no_kernel_runs(tmp_path):
    path = str(_gguf(tmp_path, gguf.GGMLQuantizationType.Q8_0))
    with pytest.raises(ModelLoadError, match=r"activations='q8' needs native quantised weights.*'float32'"):
        Model(path, device="cpu", weights="float32", activations="q8")
    with pytest.raises(ModelLoadError, match=r"activations='int4' is not one of \['fp32', 'q8'\]"):
        Model(path, device="cpu", activations="int4")


def test_q8_activations_are_refused_for_a_model_without_such_formats(tmp_path):
    _need_kernels()
    path = str(_gguf(tmp_path, gguf.GGMLQuantizationType.F16))
    with pytest.raises(ModelLoadError, match=r"no weight in a format with an 8-bit-activation kernel.*F16"):
        Model(path, device="cpu", activations="q8")


def test_a_decode_step_runs_the_q8_kernel(tmp_path):
    """The decode step (the fused decoder's path) carries the flag too: its logits move, a little."""
    _need_kernels()
    from pagedgen.core.kv import PagedKVCache
    from pagedgen.executor.inputs import SequenceChunk, pack_step

    path = str(_gguf(tmp_path, gguf.GGMLQuantizationType.Q4_1))
    logits = []
    for model in (Model(path, device="cpu"), Model(path, device="cpu", activations="q8")):
        cache = PagedKVCache(model.kv_spec, num_blocks=8, block_size=16)
        with torch.inference_mode():
            model.runtime.forward(pack_step([SequenceChunk(list(range(5, 40)), 0, [0, 1, 2])], 16), cache)
            logits.append(model.runtime.forward(pack_step([SequenceChunk([77], 35, [0, 1, 2])], 16), cache))
    exact, fast = logits
    assert not torch.equal(exact, fast)
    assert float((exact - fast).abs().max()) <= 0.05 * float(exact.abs().max())
