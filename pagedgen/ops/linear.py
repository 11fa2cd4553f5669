"""The one matmul entry point of every model's linear layers.

Kept behind a single function so the GEMM backend can be chosen per shape (see docs/performance.md)
without touching model code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x [rows, in]`` and ``weight [out, in]``."""
    return F.linear(x, weight, bias)
