"""Native CPU kernels: compiled from C on first use, loaded with ctypes, shared by every layer.

Why C, ours: at decode sizes the hot paths (paged decode attention, the small-batch GEMM, the layer ops, the
GEMM over stored blocks, the fused decode step) are bound by memory traffic and Python dispatch, and no
library of the field ships such kernels for Python on CPU (vLLM's are built into vLLM). They are built once
per machine with the system C compiler, bound to torch's OpenMP pool, and left off with a reason when they
cannot be built (:func:`native_status`). docs/performance.md, "Module notes: ops and bench", has the rest.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedgen.core.paths import cache_root

log = logging.getLogger(__name__)

DISABLE_ENV = "PAGEDGEN_NATIVE_KERNELS"
# The -march the library is built for; "native" (this CPU) unless set. Another value builds it for an older
# instruction set on this machine (x86-64-v3: AVX2, FMA, F16C, no AVX-512), to measure that variant here.
MARCH_ENV = "PAGEDGEN_KERNEL_MARCH"
_MARCH = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
KERNELS = Path(__file__).parent
SOURCES = tuple(
    KERNELS / name
    for name in (
        "paged_decode.c",
        "small_gemm.c",
        "layer_ops.c",
        "quant_gemm.c",
        "quant_q8.c",
        "quant_q8_k.c",
        "decoder_layers.c",
    )
)
# The quantised GEMMs alone (exact, 8-bit activations, the K-quants' 8-bit path): what a test builds to
# check one instruction set's variant of them.
QUANT_SOURCES = tuple(KERNELS / name for name in ("quant_gemm.c", "quant_q8.c", "quant_q8_k.c"))
HEADERS = tuple(KERNELS / name for name in ("vec_math.h", "half.h", "hsum.h", "prefetch.h", "step_barrier.h"))
CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC")
_POINTER = ctypes.c_void_p
_I64 = ctypes.c_int64


@dataclass(frozen=True, slots=True)
class NativeStatus:
    """Whether the native kernels are in use, and the reason when they are not."""

    available: bool
    detail: str  # the library path, or why the kernels are off


class DecodeKernel:
    """``paged_decode_attention_f32`` of the compiled library, with its argument checks."""

    def __init__(self, library: ctypes.CDLL):
        self._fn = library.paged_decode_attention_f32
        self._fn.argtypes = [_POINTER, _POINTER, _POINTER, _POINTER, _I64, _POINTER, _POINTER, _I64]
        self._fn.argtypes += [_I64, _I64, _I64, _I64, ctypes.c_float, _POINTER, ctypes.c_int]
        self._fn.restype = ctypes.c_int
        self._window_fn = library.paged_decode_window_attention_f32  # + int32 kv_starts after kv_lens
        self._window_fn.argtypes = self._fn.argtypes[:6] + [_POINTER] + self._fn.argtypes[6:]
        self._window_fn.restype = ctypes.c_int
        self._write = library.write_kv_f32
        self._write.argtypes = [_POINTER, _I64, _POINTER, _I64, _I64, _I64, _POINTER, _I64]
        self._write.argtypes += [_POINTER, _POINTER]
        self._write.restype = ctypes.c_int

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """Copy ``key``/``value [T, Hkv, D]`` rows into the caches' flat ``slots`` (int64, contiguous).

        The caller has checked shapes, dtypes and layouts (rows may be strided, heads and dims packed).
        Raises ``IndexError``, writing nothing, when a slot lies outside the cache.
        """
        rows, heads, dim = key.shape
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        failed = self._write(
            key.data_ptr(),
            key.stride(0),
            value.data_ptr(),
            value.stride(0),
            rows,
            heads * dim,
            slots.data_ptr(),
            num_slots,
            k_cache.data_ptr(),
            v_cache.data_ptr(),
        )
        if failed:
            raise IndexError(f"write_kv: a slot of {slots.tolist()} is outside the cache's {num_slots} slots")

    @staticmethod
    def supports(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        """fp32 CPU tensors in the contiguous layouts the kernel indexes."""
        return all(
            t.dtype is torch.float32 and t.device.type == "cpu" and t.is_contiguous()
            for t in (query, k_cache, v_cache)
        )

    def __call__(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        tables: torch.Tensor,
        kv_lens: torch.Tensor,
        token_rows: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        kv_starts: torch.Tensor | None = None,
    ) -> None:
        """Write ``out[token_rows]`` ``[B, Hq, D]`` from ``query[token_rows]`` over each row's paged keys.

        ``tables [B, W]`` int32 and ``kv_lens [B]`` int32 (contiguous), ``token_rows [B]`` int64; ``out``
        is ``query``-shaped and contiguous. ``kv_starts [B]`` int32 (sliding window): row ``r`` attends to
        keys ``kv_starts[r] .. kv_lens[r] - 1`` only. Raises ``ValueError`` on a layout the kernel cannot
        index and ``MemoryError`` if a thread could not allocate its score buffer.
        """
        if not (self.supports(query, k_cache, v_cache) and out.is_contiguous() and out.shape == query.shape):
            raise ValueError("the native decode kernel needs contiguous fp32 CPU query, out and caches")
        if (
            tables.dtype is not torch.int32
            or kv_lens.dtype is not torch.int32
            or token_rows.dtype is not torch.int64
        ):
            raise ValueError("the native decode kernel needs int32 tables/kv_lens and int64 token_rows")
        if not (tables.is_contiguous() and kv_lens.is_contiguous() and token_rows.is_contiguous()):
            raise ValueError("the native decode kernel needs contiguous tables, kv_lens and token_rows")
        _, block_size, kv_heads, head_dim = k_cache.shape
        fn, starts = self._fn, ()
        if kv_starts is not None:
            if kv_starts.dtype is not torch.int32 or not kv_starts.is_contiguous():
                raise ValueError("the native decode kernel needs contiguous int32 kv_starts")
            fn, starts = self._window_fn, (kv_starts.data_ptr(),)
        failed = fn(
            query.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            tables.data_ptr(),
            tables.shape[1],
            kv_lens.data_ptr(),
            *starts,
            token_rows.data_ptr(),
            token_rows.shape[0],
            query.shape[1],
            kv_heads,
            head_dim,
            block_size,
            scale,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("the native decode kernel could not allocate its score buffer")


class GemmKernel:
    """``small_gemm_f32`` of the compiled library: ``x @ weight.T + bias`` for decode-sized ``x``."""

    def __init__(self, library: ctypes.CDLL):
        self._fn = library.small_gemm_f32
        self._fn.argtypes = [_POINTER, _I64, _POINTER, _I64, _I64, _POINTER, _POINTER, ctypes.c_int]
        self._fn.restype = None
        self._variant = library.small_gemm_variant
        self._variant.argtypes = [_I64]
        self._variant.restype = ctypes.c_int

    def variant(self, in_features: int) -> str:
        """The code path a call with this input size takes: ``avx512``, ``avx2`` or ``portable``.

        Chosen by the host's instruction set (compiled with ``-march=native``) and ``in_features`` only,
        never by the row count, so a row's result does not depend on its batch.
        """
        return ("portable", "avx2", "avx512")[self._variant(in_features)]

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``[rows, out]`` for fp32 CPU ``x [rows, in]``, contiguous ``weight [out, in]`` and ``bias [out]``.

        The caller (:func:`pagedgen.ops.matmul.linear.linear`) has checked dtypes, devices and the weight
        layout.
        """
        x = x.contiguous()
        rows, k = x.shape
        out = torch.empty(rows, weight.shape[0], dtype=torch.float32)  # [rows, out]
        bias = None if bias is None else bias.contiguous()  # held: its memory must outlive the call
        bias_ptr = None if bias is None else bias.data_ptr()
        self._fn(
            x.data_ptr(),
            rows,
            weight.data_ptr(),
            k,
            weight.shape[0],
            bias_ptr,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out


class LayerOpsKernels:
    """The per-layer elementwise kernels of ``layer_ops.c``; callers (:mod:`pagedgen.ops.layers.layer_ops`)
    check that tensors are fp32, on the CPU and laid out as each function's docstring says."""

    def __init__(self, library: ctypes.CDLL):
        f32 = ctypes.c_float
        threads = ctypes.c_int
        self._rms = library.rms_norm_f32
        self._rms.argtypes = [_POINTER, _I64, _I64, _POINTER, f32, _POINTER, threads]
        self._add_rms = library.add_rms_norm_f32
        self._add_rms.argtypes = [_POINTER, _POINTER, _I64, _I64, _POINTER, f32, _POINTER, threads]
        self._rotary = library.rotary_f32
        self._rotary.argtypes = [_POINTER, _I64, _I64, _I64, _I64, _POINTER, _POINTER, threads]
        self._silu_mul = library.silu_mul_f32
        self._silu_mul.argtypes = [_POINTER, _I64, _I64, _POINTER, threads]
        self._head_rms = library.head_rms_norm_f32
        self._head_rms.argtypes = [_POINTER, _I64, _I64, _I64, _I64, _POINTER, f32, threads]
        for fn in (self._rms, self._add_rms, self._rotary, self._silu_mul, self._head_rms):
            fn.restype = None
        self._gated = library.gated_act_f32
        self._gated.argtypes = [_POINTER, _POINTER, _I64, _I64, _I64, ctypes.c_int, _POINTER, threads]
        self._gated.restype = ctypes.c_int

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Contiguous ``x [rows, dim]`` -> a new ``[rows, dim]``."""
        out = torch.empty_like(x)
        rows, dim = x.shape
        self._rms(x.data_ptr(), rows, dim, weight.data_ptr(), eps, out.data_ptr(), torch.get_num_threads())
        return out

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """Adds contiguous ``delta`` into contiguous ``residual [rows, dim]`` in place; returns the norm."""
        out = torch.empty_like(residual)
        rows, dim = residual.shape
        self._add_rms(
            residual.data_ptr(),
            delta.data_ptr(),
            rows,
            dim,
            weight.data_ptr(),
            eps,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out

    def rotary_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotates ``x [T, H, D]`` (rows at any stride, heads and dims contiguous) in place."""
        rows, heads, dim = x.shape
        self._rotary(
            x.data_ptr(),
            rows,
            heads,
            dim,
            x.stride(0),
            cos.data_ptr(),
            sin.data_ptr(),
            torch.get_num_threads(),
        )

    def head_rms_norm_(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        """RMSNorm of each head of ``x [T, H, D]`` in place (rows at any stride; heads, dims contiguous)."""
        rows, heads, dim = x.shape
        self._head_rms(
            x.data_ptr(), rows, heads, dim, x.stride(0), weight.data_ptr(), eps, torch.get_num_threads()
        )

    def gated_act(self, gate: torch.Tensor, up: torch.Tensor, activation: int) -> torch.Tensor:
        """``act(gate) * up`` for ``[rows, inner]`` views sharing one row stride (dims contiguous);
        ``activation`` 0 silu, 1 gelu_tanh. Returns a new contiguous ``[rows, inner]``."""
        rows, inner = gate.shape
        out = torch.empty(rows, inner, dtype=gate.dtype)
        failed = self._gated(
            gate.data_ptr(),
            up.data_ptr(),
            rows,
            inner,
            gate.stride(0),
            activation,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if failed:
            raise ValueError(f"gated_act_f32: unknown activation {activation}")
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """Contiguous ``[rows, 2 * inner]`` -> ``silu(gate) * up`` ``[rows, inner]``."""
        rows, inner = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, inner, dtype=gate_up.dtype)
        self._silu_mul(gate_up.data_ptr(), rows, inner, out.data_ptr(), torch.get_num_threads())
        return out


@dataclass(frozen=True, slots=True)
class _Library:
    decode: DecodeKernel | None
    gemm: GemmKernel | None
    layer_ops: LayerOpsKernels | None
    status: NativeStatus
    library: ctypes.CDLL | None = None  # for kernels wrapped in their own modules (ops/matmul/quant_gemm.py)


_lock = threading.Lock()
_loaded: list[_Library] = []


def decode_kernel() -> DecodeKernel | None:
    """The compiled paged decode kernel, built on first call; ``None`` when native kernels are unavailable."""
    return _load().decode


def gemm_kernel() -> GemmKernel | None:
    """The compiled small-batch GEMM, built on first call; ``None`` when native kernels are unavailable."""
    return _load().gemm


def layer_ops_kernels() -> LayerOpsKernels | None:
    """The compiled per-layer elementwise kernels; ``None`` when native kernels are unavailable."""
    return _load().layer_ops


def native_library() -> ctypes.CDLL | None:
    """The loaded library itself, for wrappers that live beside their callers; ``None`` when unavailable."""
    return _load().library


def native_status() -> NativeStatus:
    return _load().status


def _load() -> _Library:
    with _lock:
        if not _loaded:
            _loaded.append(_build_and_load())
        return _loaded[0]


def _build_and_load() -> _Library:
    """Build (or find) and load the library; never raises: a failure turns the native kernels off."""
    if os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return _Library(None, None, None, NativeStatus(False, f"disabled by {DISABLE_ENV}"))
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return _off("no C compiler found (set CC)")
    try:
        path = _build(compiler, _cflags())
        runtimes_before = _openmp_runtimes()
        library = ctypes.CDLL(str(path))
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        return _off(f"building the native kernels failed: {exc}")
    runtimes = _openmp_runtimes()
    if len(runtimes) > max(1, len(runtimes_before)):
        return _off(f"the kernel loaded a second OpenMP runtime beside torch's: {sorted(runtimes)}")
    kernels = (DecodeKernel(library), GemmKernel(library), LayerOpsKernels(library))
    return _Library(*kernels, NativeStatus(True, str(path)), library)


def _off(reason: str) -> _Library:
    log.warning("pagedgen native kernels are off (pure-torch attention, OpenBLAS/torch GEMMs): %s", reason)
    return _Library(None, None, None, NativeStatus(False, reason))


def kernel_march() -> str:
    """The -march the library is (to be) built for: :data:`MARCH_ENV`'s value, else ``native``."""
    return os.environ.get(MARCH_ENV, "").strip() or "native"


def _cflags() -> tuple[str, ...]:
    """CFLAGS with :func:`kernel_march`; a value that is not one word is refused."""
    march = kernel_march()
    if not _MARCH.fullmatch(march):
        raise ValueError(
            f"{MARCH_ENV}={march!r} is not a -march value (one word such as x86-64-v3 or znver3)"
        )
    return tuple(f"-march={march}" if flag == "-march=native" else flag for flag in CFLAGS)


def _build(compiler: str, cflags: tuple[str, ...]) -> Path:
    """Compile the library into the cache unless an entry for this source/flags/compiler/CPU exists."""
    sources = [source.read_bytes() for source in (*SOURCES, *HEADERS)]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60, check=True)
    key = hashlib.sha256(
        b"\0".join([*sources, " ".join(cflags).encode(), version.stdout.encode(), _cpu_id()])
    )
    directory = cache_root() / "kernels"
    path = directory / f"pagedgen-kernels-{key.hexdigest()[:16]}.so"
    if path.exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".so.tmp")
    os.close(fd)
    try:
        result = subprocess.run(
            [compiler, *cflags, "-o", tmp, *map(str, SOURCES)], capture_output=True, text=True, timeout=300
        )
        if result.returncode != 0:
            raise subprocess.SubprocessError(result.stderr.strip() or f"exit status {result.returncode}")
        os.replace(tmp, path)  # atomic: a concurrent builder never loads a half-written file
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path


def _cpu_id() -> bytes:
    """What ``-march=native`` depends on: the CPU model and its feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor().encode()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return "\n".join([platform.machine(), *wanted]).encode()


def _openmp_runtimes() -> set[str]:
    """Distinct OpenMP runtime files mapped into this process (Linux; empty elsewhere)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return set()
    names = ("libgomp", "libiomp", "libomp")
    return {line.split()[-1] for line in maps if any(n in line.rsplit("/", 1)[-1] for n in names)}
