"""ops.layer_ops: the native elementwise kernels equal the torch reference formulas, and fall back to them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedgen.ops import layer_ops
from pagedgen.ops.layer_ops import (
    add_rms_norm,
    apply_rotary_,
    rms_norm,
    rms_norm_reference,
    rotary_reference,
    silu_and_mul,
)
from pagedgen.ops.native import layer_ops_kernels, native_status

pytestmark = pytest.mark.cpu  # the native elementwise CPU kernels


@pytest.fixture(params=["native", "torch"])
def path(request, monkeypatch):
    """Run each test once through the native kernels and once through the torch fallback."""
    if request.param == "native":
        if layer_ops_kernels() is None:
            pytest.skip(native_status().detail)
    else:
        monkeypatch.setattr(layer_ops, "layer_ops_kernels", lambda: None)
    return request.param


@pytest.mark.parametrize("rows", [1, 5, 70])  # 70: the kernels' multi-threaded branch
def test_rms_norm_matches_the_reference(path, rows):
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 576, generator=gen) * 3, torch.randn(576, generator=gen)
    got = rms_norm(x, w, 1e-5)
    assert got.shape == x.shape
    assert torch.allclose(got, rms_norm_reference(x, w, 1e-5), rtol=1e-5, atol=1e-5)


def test_rms_norm_over_heads_of_a_3d_tensor(path):
    x, w = torch.randn(4, 9, 64), torch.randn(64)
    assert torch.allclose(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 70])
def test_add_rms_norm_returns_the_sum_and_its_norm(path, rows):
    gen = torch.Generator().manual_seed(7)
    residual, delta = torch.randn(rows, 576, generator=gen), torch.randn(rows, 576, generator=gen)
    w = torch.randn(576, generator=gen)
    expected_sum = residual + delta
    new_residual, normed = add_rms_norm(residual.clone(), delta, w, 1e-5)
    assert torch.equal(new_residual, expected_sum)
    assert torch.allclose(normed, rms_norm_reference(expected_sum, w, 1e-5), rtol=1e-5, atol=1e-5)


def test_rotary_in_place_on_a_view_into_a_fused_projection(path):
    """q and k are strided views into one [T, q + k + v] product; only their elements change."""
    tokens, d = 6, 64
    qkv = torch.randn(tokens, (9 + 3 + 3) * d)
    original = qkv.clone()
    q, k, _ = qkv.split([9 * d, 3 * d, 3 * d], dim=1)
    q, k = q.view(tokens, 9, d), k.view(tokens, 3, d)
    angles = torch.arange(tokens)[:, None] * torch.linspace(0.01, 1.0, d // 2)[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    want_q = rotary_reference(q.clone(), cos, sin)
    want_k = rotary_reference(k.clone(), cos, sin)
    assert apply_rotary_(q, cos, sin) is q and apply_rotary_(k, cos, sin) is k
    assert torch.allclose(q, want_q, atol=1e-6) and torch.allclose(k, want_k, atol=1e-6)
    assert torch.equal(qkv[:, 12 * d :], original[:, 12 * d :])  # v untouched


@pytest.mark.parametrize("rows", [1, 70])
def test_silu_and_mul_matches_torch_over_the_whole_range(path, rows):
    gen = torch.Generator().manual_seed(3)
    gate_up = torch.randn(rows, 2 * 1536, generator=gen) * 8
    gate_up[0, :6] = torch.tensor([-200.0, -90.0, -87.0, 0.0, 87.0, 200.0])  # the exp clamp edges
    gate, up = gate_up.chunk(2, dim=-1)
    got = silu_and_mul(gate_up)
    assert got.shape == (rows, 1536)
    assert torch.allclose(got, F.silu(gate) * up, rtol=2e-6, atol=1e-6)


def test_other_dtypes_take_the_reference_path():
    x, w = torch.randn(3, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    assert torch.equal(rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5))
    gate_up = torch.randn(2, 16, dtype=torch.float64)
    assert torch.equal(silu_and_mul(gate_up), F.silu(gate_up[:, :8]) * gate_up[:, 8:])
