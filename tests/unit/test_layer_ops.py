"""ops.layers.layer_ops: the native elementwise kernels equal the torch formulas, or fall back to them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedgen.ops.kernels.native import layer_ops_kernels, native_status
from pagedgen.ops.layers import layer_ops
from pagedgen.ops.layers.layer_ops import (
    Activation,
    add_rms_norm,
    apply_rotary_,
    gated_activation,
    rms_norm,
    rms_norm_heads_,
    rms_norm_reference,
    rotary_reference,
    silu_and_mul,
)

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


@pytest.mark.parametrize("dim", [37, 64, 576, 640, 2048])
@pytest.mark.parametrize("rows", [[0], [2, 0], list(range(70))])  # 70: the kernels' multi-threaded branch
def test_the_fused_add_and_norm_of_gathered_rows_has_the_add_then_norm_bits(path, rows, dim):
    """The models' final norm of the logits rows, ``add_rms_norm(x[rows], delta[rows])``, gives the bits of
    the add followed by ``rms_norm`` it replaced, on the native kernels and on the torch fallback."""
    gen = torch.Generator().manual_seed(dim + len(rows))
    x, delta = torch.randn(80, dim, generator=gen) * 4, torch.randn(80, dim, generator=gen)
    w, index = torch.randn(dim, generator=gen), torch.tensor(rows)
    summed, normed = add_rms_norm(x[index], delta[index], w, 1e-6)
    want = x[index] + delta[index]
    assert torch.equal(summed, want) and torch.equal(normed, rms_norm(want, w, 1e-6))


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


@pytest.mark.parametrize("activation", list(Activation), ids=lambda a: a.name)
@pytest.mark.parametrize("rows", [1, 70])
def test_gated_activation_matches_torch_on_fused_halves_and_separate_products(path, rows, activation):
    gen = torch.Generator().manual_seed(4)
    gate_up = torch.randn(rows, 2 * 640, generator=gen) * 6
    gate_up[0, :8] = torch.tensor([-200.0, -90.0, -12.0, -1e-4, 0.0, 3e-3, 87.0, 200.0])  # clamp edges, ~0
    gate, up = gate_up.chunk(2, dim=-1)
    torch_act = F.silu if activation is Activation.SILU else lambda g: F.gelu(g, approximate="tanh")
    want = (torch_act(gate.double()) * up.double()).float()  # torch's fp32 GELU-tanh flushes below -5
    for args in ((gate, up), (gate.contiguous(), up.contiguous())):
        got = gated_activation(*args, activation)
        assert got.shape == (rows, 640) and got.is_contiguous()
        if path == "torch":
            assert torch.equal(got, torch_act(gate) * up)
        else:
            assert torch.allclose(got, want, rtol=3e-6, atol=1e-6)
            assert torch.allclose(got, torch_act(gate) * up, rtol=1e-5, atol=2e-5)
    if activation is Activation.SILU:  # SwiGLU's fused entry is the same kernel, bit for bit
        assert torch.equal(silu_and_mul(gate_up), gated_activation(gate, up, activation))


@pytest.mark.parametrize("rows", [1, 3, 70])
def test_head_norm_norms_each_head_of_a_strided_view_in_place(path, rows):
    """q and k are views into one q/k/v product; each head is normed exactly as a row of head_dim."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, d = 4, 2, 32
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=gen) * 3
    original = qkv.clone()
    q = qkv[:, : heads * d].view(rows, heads, d)
    w = torch.randn(d, generator=gen)
    got = rms_norm_heads_(q, w, 1e-6)
    if path == "torch":
        assert got is None and torch.equal(qkv, original)  # untouched: the caller norms it
        return
    assert got is q
    want = rms_norm(original[:, : heads * d].reshape(rows * heads, d), w, 1e-6).view(rows, heads, d)
    assert torch.equal(q, want)
    assert torch.allclose(q, rms_norm_reference(original[:, : heads * d].view(rows, heads, d), w, 1e-6))
    assert torch.equal(qkv[:, heads * d :], original[:, heads * d :])  # k and v untouched


def test_other_dtypes_take_the_reference_path():
    x, w = torch.randn(3, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    assert torch.equal(rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5))
    gate_up = torch.randn(2, 16, dtype=torch.float64)
    assert torch.equal(silu_and_mul(gate_up), F.silu(gate_up[:, :8]) * gate_up[:, 8:])
