"""The one matmul entry point of every model's linear layers.

Kept behind a single function so the GEMM backend is chosen per shape (:mod:`pagedgen.ops.matmul.gemm`,
docs/performance.md) without touching model code: CPU fp32 calls go to the backend the active
:class:`~pagedgen.ops.matmul.gemm.GemmTable` names for ``(rows, in, out)``; everything else (CUDA, half
precision, autograd, 3-D inputs) goes to ``F.linear``. A weight kept in its stored format (a
:class:`~pagedgen.ops.matmul.qweight.QuantizedWeight`) goes to
:func:`pagedgen.ops.matmul.quant_gemm.quantized_linear`.
"""

from __future__ import annotations

import torch

from pagedgen.ops.matmul.gemm import (
    GemmBackend,
    choose_backend,
    native_gemm,
    openblas_eligible,
    openblas_gemm,
    torch_gemm,
)
from pagedgen.ops.matmul.quant_gemm import quantized_linear
from pagedgen.ops.matmul.qweight import QuantizedWeight


def linear(
    x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x [rows, in]`` and ``weight [out, in]``; returns ``[rows, out]``."""
    if isinstance(weight, QuantizedWeight):
        return quantized_linear(x, weight, bias)
    if openblas_eligible(x, weight, bias):
        backend = choose_backend(x.shape[0], weight.shape[1], weight.shape[0])
        if backend is GemmBackend.NATIVE:
            return native_gemm(x, weight, bias)
        if backend is GemmBackend.OPENBLAS:
            return openblas_gemm(x, weight, bias)
    return torch_gemm(x, weight, bias)
