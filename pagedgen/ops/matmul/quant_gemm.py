"""Linear layers and embedding lookups over a :class:`~pagedgen.ops.matmul.qweight.QuantizedWeight`.

Why two paths: the native kernel streams the packed blocks once and expands them in L1 (bandwidth-bound: the
path for few rows, decode and the LM head), while dequantise + torch's GEMM is compute-bound and wins at many
rows (prefill); a call takes what the installed :class:`~pagedgen.ops.matmul.quant_table.QuantTable` names for
its kind and row count. docs/performance.md, "Module notes: ops and bench", has the rest.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import torch

from pagedgen.ops.kernels.native import native_library
from pagedgen.ops.matmul.gemm import torch_gemm
from pagedgen.ops.matmul.gemm_threads import torch_pool
from pagedgen.ops.matmul.quant_table import QuantPath, quant_path
from pagedgen.ops.matmul.qweight import QType, QuantizedWeight

TILE_BYTES = 8 << 20  # fp32 bytes of one dequantised weight tile on the many-row path

_POINTER = ctypes.c_void_p
_I64 = ctypes.c_int64


class QuantKernels:
    """``quant_gemm_f32`` and ``quant_dequantize_rows`` of a compiled library (any build of the source)."""

    def __init__(self, library: ctypes.CDLL):
        self._gemm = library.quant_gemm_f32
        self._gemm.argtypes = [_POINTER, _I64, _POINTER, _I64, ctypes.c_int, _I64, _I64, _POINTER, _POINTER]
        self._gemm.argtypes += [ctypes.c_int]
        self._gemm.restype = ctypes.c_int
        self._rows = library.quant_dequantize_rows
        self._rows.argtypes = [_POINTER, _I64, ctypes.c_int, _I64, _POINTER, _I64, _POINTER, ctypes.c_int]
        self._rows.restype = ctypes.c_int

    def gemm(self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """``[rows, out]`` for fp32 CPU ``x [rows, in]`` and fp32 ``bias [out]``; raises ``MemoryError``."""
        x = x.contiguous()
        out_features, k = weight.shape
        out = torch.empty(x.shape[0], out_features, dtype=torch.float32)  # [rows, out]
        bias = None if bias is None else bias.contiguous()  # held: its memory must outlive the call
        failed = self._gemm(
            x.data_ptr(),
            x.shape[0],
            weight.data.data_ptr(),
            weight.data.shape[1],
            weight.kernel_id,
            k,
            out_features,
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError(f"quant_gemm_f32 failed ({failed}) for {weight.qtype.name} {weight.shape}")
        return out

    def dequantize(self, weight: QuantizedWeight, rows: torch.Tensor | None) -> torch.Tensor:
        """fp32 ``[len(rows) or out, in]``; ``rows`` int64 contiguous, already checked to be in range."""
        count = weight.shape[0] if rows is None else rows.shape[0]
        out = torch.empty(count, weight.shape[1], dtype=torch.float32)  # [count, in]
        failed = self._rows(
            weight.data.data_ptr(),
            weight.data.shape[1],
            weight.qtype.ggml_id,
            weight.shape[1],
            None if rows is None else rows.data_ptr(),
            count,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if failed:
            raise ValueError(f"quant_dequantize_rows does not know {weight.qtype.name}")
        return out


_lock = threading.Lock()
_kernels: list[QuantKernels | None] = []


def quant_kernels() -> QuantKernels | None:
    """The wrapper over the shared native library; ``None`` when native kernels are unavailable."""
    if _kernels:  # decided: no lock on the per-call path
        return _kernels[0]
    with _lock:
        if not _kernels:
            library = native_library()
            _kernels.append(None if library is None else QuantKernels(library))
        return _kernels[0]


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [rows, in] @ dequant(weight).T (+ bias)`` -> ``[rows, out]``, by the path for ``rows``."""
    if x.dim() == 2 and use_quant_kernel(weight, x.shape[0]):
        return quant_gemm(x, weight, bias)
    return tiled_dequant_gemm(x, weight, bias)


def use_quant_kernel(weight: QuantizedWeight, rows: int) -> bool:
    """True when the native kernel (:func:`quant_gemm`) is the path for ``weight`` at ``rows`` rows, False
    for dequantise + torch GEMM; always False when the native kernels are unavailable.

    Follows the installed table (module docstring); memoised per (format, shape, rows), so a call costs
    one dict lookup.
    """
    if quant_kernels() is None:
        return False
    return quant_path(weight.qtype, weight.shape, rows) is QuantPath.KERNEL


def tiled_dequant_gemm(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ dequant(weight).T (+ bias)`` by torch's GEMM over dequantised tiles of output rows."""
    out_features, k = weight.shape
    tile = max(16, TILE_BYTES // (4 * k))
    if tile >= out_features:
        return torch_gemm(x, dequantize(weight), bias)
    pieces = []
    for start in range(0, out_features, tile):
        end = min(start + tile, out_features)
        part_bias = None if bias is None else bias[start:end]
        pieces.append(torch_gemm(x, dequantize(weight.rows(start, end)), part_bias))  # [rows, end - start]
    return torch.cat(pieces, dim=-1)  # [rows, out]


def quant_gemm(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The native kernel alone, at any row count (a backend the GEMM calibration can time).

    Raises ``RuntimeError`` without the native kernels, ``ValueError`` for an ``x`` it cannot take.
    """
    kernels = quant_kernels()
    if kernels is None:
        raise RuntimeError(
            "quant_gemm needs the native kernels (pagedgen.ops.kernels.native.native_status())"
        )
    if x.dtype is not torch.float32 or x.device.type != "cpu" or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"quant_gemm needs fp32 CPU x [rows, {weight.shape[1]}], got {x.dtype} {x.shape}")
    torch_pool.restore()
    return kernels.gemm(x, weight, bias)


def _out_of_range(rows: torch.Tensor, count: int) -> bool:
    """Whether an id of ``rows`` (int64, on the CPU when it is short) lies outside ``[0, count)``.

    A few ids (a decode step's embedding lookup) are read as one list: two torch reductions and two
    scalar reads cost about 10x more than the list at one or a few ids."""
    if rows.numel() <= 64 and rows.device.type == "cpu":
        ids = rows.tolist()
        return bool(ids) and (min(ids) < 0 or max(ids) >= count)
    return bool(rows.numel()) and (int(rows.min()) < 0 or int(rows.max()) >= count)


def dequantize(weight: QuantizedWeight, rows: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``[out, in]`` (or only ``rows``, int64 ``[n]``), bit-identical to ``gguf.quants.dequantize``.

    Raises ``IndexError`` for a row outside ``[0, out)``. Without the native kernels, a numpy fallback.
    """
    if rows is not None:
        rows = rows.to(torch.int64).contiguous()
        if _out_of_range(rows, weight.shape[0]):
            raise IndexError(f"dequantize: row ids {rows.tolist()} outside [0, {weight.shape[0]})")
    kernels = quant_kernels()
    if kernels is not None:
        torch_pool.restore()
        return kernels.dequantize(weight, rows)
    data = weight.data if rows is None else weight.data[rows]
    return _dequantize_numpy(weight.qtype, data, weight.shape[1])


def embedding(ids: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """``[*ids.shape, in]``: only the looked-up rows are dequantised."""
    return dequantize(weight, ids.reshape(-1)).reshape(*ids.shape, weight.shape[1])


def _dequantize_numpy(qtype: QType, data: torch.Tensor, k: int) -> torch.Tensor:
    if qtype is QType.F16:
        return data.view(torch.float16).float()
    if qtype is QType.BF16:
        return data.view(torch.bfloat16).float()
    import gguf

    values = gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType[qtype.name])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(-1, k))
