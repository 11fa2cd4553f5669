"""The elementwise ops of a decoder layer, each one native call when it can be, else the torch reference.

Why: at decode sizes an RMSNorm or a rotary embedding written as torch ops is 5-10 dispatches of
microsecond-sized work; 30 layers of them were a third of a batch-1 forward (docs/performance.md). The
native versions (``kernels/layer_ops.c``) do the same float32 arithmetic in one pass. Every function falls
back to the torch formula (also the oracle of the tests) for other dtypes, devices or layouts, and when no
native kernels were built.
"""

from __future__ import annotations

import enum

import torch
import torch.nn.functional as F

from pagedgen.ops.kernels.native import layer_ops_kernels


def _native_ok(*tensors: torch.Tensor) -> bool:
    return all(t.dtype is torch.float32 and t.device.type == "cpu" for t in tensors)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as the reference implementations compute it: float32 statistics, cast back, then the weight."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x [..., dim]``; returns a new tensor."""
    kernels = layer_ops_kernels()
    if kernels is not None and _native_ok(x, weight) and x.is_contiguous() and weight.is_contiguous():
        return kernels.rms_norm(x.view(-1, x.shape[-1]), weight, eps).view(x.shape)
    return rms_norm_reference(x, weight, eps)


def add_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual + delta`` and its RMSNorm, for ``[rows, dim]`` tensors: ``(new residual, normed)``.

    The native path adds into ``residual`` in place (the caller owns it: the model's residual stream).
    """
    kernels = layer_ops_kernels()
    if (
        kernels is not None
        and _native_ok(residual, delta, weight)
        and residual.dim() == 2
        and residual.is_contiguous()
        and delta.is_contiguous()
        and weight.is_contiguous()
        and residual.shape == delta.shape
    ):
        return residual, kernels.add_rms_norm(residual, delta, weight, eps)
    residual = residual + delta
    return residual, rms_norm_reference(residual, weight, eps)


def rms_norm_heads_(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm of each head of ``x [T, H, D]`` in place (q/k norms), when the native kernel can take it.

    ``x`` may be a view into a fused q/k/v product (rows at any stride, heads and dims contiguous). Returns
    ``x``, or ``None`` (``x`` untouched) when it cannot: the caller then runs its own norm's formula.
    """
    kernels = layer_ops_kernels()
    if (
        kernels is not None
        and _native_ok(x, weight)
        and x.dim() == 3
        and x.stride(2) == 1
        and x.stride(1) == x.shape[2]
        and weight.is_contiguous()
        and weight.shape == (x.shape[2],)
    ):
        kernels.head_rms_norm_(x, weight, eps)
        return x
    return None


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` by the "rotate half" convention of HF checkpoints (cos, sin ``[T, D]``)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` in place (a view into a fused q/k/v product is fine); returns ``x``."""
    kernels = layer_ops_kernels()
    if (
        kernels is not None
        and _native_ok(x, cos, sin)
        and x.dim() == 3
        and x.stride(2) == 1
        and x.stride(1) == x.shape[2]
        and cos.is_contiguous()
        and sin.is_contiguous()
    ):
        kernels.rotary_(x, cos, sin)
        return x
    return x.copy_(rotary_reference(x, cos, sin))


class Activation(enum.IntEnum):
    """The gate activation of a gated MLP; the value is the native kernels' code."""

    SILU = 0  # SwiGLU: Llama, Qwen, Mistral
    GELU_TANH = 1  # GeGLU with the tanh approximation: Gemma


def gated_activation(gate: torch.Tensor, up: torch.Tensor, activation: Activation) -> torch.Tensor:
    """``act(gate) * up`` for ``[rows, inner]`` tensors (two products, or the halves of one fused product).

    Native (one pass) when both are fp32 CPU 2-D views with contiguous rows at one stride; else torch.
    """
    kernels = layer_ops_kernels()
    if (
        kernels is not None
        and _native_ok(gate, up)
        and gate.dim() == 2
        and gate.shape == up.shape
        and gate.stride(1) == 1
        and up.stride(1) == 1
        and gate.stride(0) == up.stride(0)
    ):
        return kernels.gated_act(gate, up, int(activation))
    if activation is Activation.SILU:
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh") * up


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` for ``gate_up [rows, 2 * inner]`` (gate first) -> ``[rows, inner]``."""
    kernels = layer_ops_kernels()
    if kernels is not None and _native_ok(gate_up) and gate_up.dim() == 2 and gate_up.is_contiguous():
        return kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
