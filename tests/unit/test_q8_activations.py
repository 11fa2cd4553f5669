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

Q8_TYPES = sorted(Q8_ACTIVATION_TYPES, key=lambda q: q.ggml_id)
_F32 = np.float32


def _need_kernels():
    if quant_kernels() is None:
        pytest.skip(native.native_status().detail)


def _build(tmp_path_factory, name: str, flags: list[str]) -> ctypes.CDLL:
    compiler = shutil.which("cc") or shutil.which("gcc")
    path = tmp_path_factory.mktemp("kernels") / f"q8-{name}.so"
    sources = [str(native.KERNELS / f) for f in ("quant_gemm.c", "quant_q8.c")]
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
@pytest.mark.parametrize("qtype", Q8_TYPES, ids=lambda q: q.name)
def test_column_slices_of_the_q8_kernel_have_its_bits(library, qtype, rows):
    """decoder_layers.c splits each GEMM's outputs over its threads at any row, multiple of 8 or not:
    every split gives the whole kernel's bits, with and without a bias (one x row: the one-row body, its
    odd last block too; three: the many-row one; 20: AVX-512's panels, a short second one)."""
    weight, x = _weight(qtype, 37, 96, seed=4), _x(rows, 96, seed=4)
    bias = torch.randn(37, generator=torch.Generator().manual_seed(4))
    for b in (None, bias):
        whole = reference(x, weight, b)
        for cuts in ([], [8, 16, 24, 32], [5, 13], [1, 36]):
            np.testing.assert_array_equal(_column_slices(library, x, weight, b, cuts), whole)


def test_the_q8_slice_entry_refuses_what_has_no_kernel(library):
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    library.quant_gemm_q8_rows.argtypes = [p, i64, p, i64, ctypes.c_int, i64, i64, i64, p, p, i64]
    library.quant_q8_quantize.argtypes = [p, i64, i64, p]
    check = library.quant_gemm_q8_rows
    assert check(None, 1, None, 0, QType.Q4_K.ggml_id, 256, 0, 0, None, None, 0) == -1  # no q8 kernel
    assert (
        check(None, 1, None, 0, QType.Q4_1.ggml_id, 48, 0, 0, None, None, 0) == -1
    )  # k not a multiple of 32
    assert check(None, 1, None, 0, QType.Q4_1.ggml_id, 64, 0, 0, None, None, 0) == 0
    assert library.quant_q8_quantize(None, 1, 48, None) == -1


@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q8_0], ids=lambda q: q.name)
def test_a_q8_rows_bits_do_not_depend_on_the_batch_or_the_thread_count(qtype):
    _need_kernels()
    kernels = quant_kernels()
    weight, x = _q8(_weight(qtype, 75, 576, seed=5)), _x(6, 576, seed=5)
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
    with pytest.raises(ValueError, match="Q4_K has no 8-bit-activation kernel"):
        _q8(random_weight(QType.Q4_K, 8, 256))
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
