"""Sliding-window paged attention: every path (native decode kernel, torch decode buckets, prefill SDPA), read
through a window ring or through plain block tables, equals dense attention over each query's last W keys.

The rings are filled the way the engine fills them: positions written in order, so older positions are
overwritten in place; a read of anything outside the window (or a ring slot mix-up) changes the result.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedgen.core.window_geometry import ring_blocks, ring_slot
from pagedgen.executor.inputs import SequenceChunk, pack_step
from pagedgen.ops import native
from pagedgen.ops.attention import paged_attention, plan_attention, write_kv


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def dense_window_attention(query, keys, values, past, window, scale, softcap=None):
    """``query [q, Hq, D]`` at positions past.. over ``keys/values [past + q, Hkv, D]``, float64; with
    ``softcap`` each score becomes ``softcap * tanh(score / softcap)`` before the softmax."""
    group = query.shape[1] // keys.shape[1]
    out = torch.empty(query.shape, dtype=torch.float64)
    for j in range(query.shape[0]):
        p = past + j
        lo = max(0, p - window + 1)
        k = keys[lo : p + 1].double().repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = values[lo : p + 1].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,khd->hk", query[j].double(), k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        probs = torch.softmax(scores, dim=-1)
        out[j] = torch.einsum("hk,khd->hd", probs, v)
    return out


def run_case(
    seqs, window, block_size, kv_heads, group, head_dim, seed, ring: bool, use_native: bool, softcap=None
):
    gen = torch.Generator().manual_seed(seed)
    chunk = max(q for _, q in seqs)
    r = ring_blocks(chunk, window, block_size)
    per_request = r if ring else max(-(-(p + q) // block_size) for p, q in seqs)
    num_blocks = per_request * len(seqs) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)  # noise
    chunks, dense = [], []
    for i, (past, q) in enumerate(seqs):
        blocks = perm[i * per_request : (i + 1) * per_request]
        keys = torch.randn(past + q, kv_heads, head_dim, generator=gen)
        values = torch.randn(past + q, kv_heads, head_dim, generator=gen)
        for p in range(past):  # history written in order: a ring overwrites its oldest positions
            slot = (
                ring_slot(blocks, p, block_size)
                if ring
                else blocks[p // block_size] * block_size + p % block_size
            )
            k_cache.view(-1, kv_heads, head_dim)[slot] = keys[p]
            v_cache.view(-1, kv_heads, head_dim)[slot] = values[p]
        if ring:
            chunks.append(
                SequenceChunk([0] * q, past, list(range(-(-(past + q) // block_size))), window_ring=blocks)
            )
        else:
            chunks.append(SequenceChunk([0] * q, past, blocks))
        dense.append((keys, values))
    inputs = pack_step(chunks, block_size, window=window if ring else None)
    plan = plan_attention(inputs, k_cache, use_native=use_native, window=window)
    new_keys = torch.cat([k[p:] for (k, _), (p, _) in zip(dense, seqs, strict=True)])
    new_values = torch.cat([v[p:] for (_, v), (p, _) in zip(dense, seqs, strict=True)])
    write_kv(new_keys, new_values, k_cache, v_cache, plan.slot_mapping)
    query = torch.randn(inputs.num_tokens, kv_heads * group, head_dim, generator=gen)
    scale = head_dim**-0.5
    if softcap is not None:
        query = query * 4  # scores of a few units, where the cap bends them
    out = paged_attention(query, k_cache, v_cache, inputs, scale, plan, softcap=softcap)
    cu = inputs.cu_seqlens.tolist()
    for i, (past, _) in enumerate(seqs):
        expected = dense_window_attention(query[cu[i] : cu[i + 1]], *dense[i], past, window, scale, softcap)
        torch.testing.assert_close(out[cu[i] : cu[i + 1]].double(), expected, atol=2e-5, rtol=2e-5)
    return plan


SEQS = st.lists(st.tuples(st.integers(0, 70), st.integers(1, 9)), min_size=1, max_size=4)


@settings(max_examples=150, deadline=None)
@given(
    seqs=SEQS,
    window=st.integers(1, 20),
    block_size=st.sampled_from([1, 2, 4, 16]),
    kv_heads=st.integers(1, 2),
    group=st.integers(1, 3),
    seed=st.integers(0, 2**16),
    ring=st.booleans(),
    use_native=st.booleans(),
)
def test_windowed_attention_matches_dense_window_attention(
    seqs, window, block_size, kv_heads, group, seed, ring, use_native
):
    run_case(seqs, window, block_size, kv_heads, group, 8, seed, ring, use_native)


@settings(max_examples=40, deadline=None)
@given(
    seqs=SEQS,
    window=st.integers(1, 12),
    block_size=st.sampled_from([1, 4]),
    seed=st.integers(0, 2**16),
    ring=st.booleans(),
    use_native=st.booleans(),
)
def test_softcapped_windowed_attention_matches_dense_window_attention(
    seqs, window, block_size, seed, ring, use_native
):
    """Gemma 2's soft-capped scores through every windowed path (a native plan falls back to torch)."""
    run_case(seqs, window, block_size, 2, 2, 8, seed, ring, use_native, softcap=1.5)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("use_native", [True, False])
def test_decode_rows_at_every_ring_alignment(head_dim, use_native):
    """Single-token rows whose window starts at every offset of a block, wrapping the ring many times."""
    seqs = [(past, 1) for past in range(0, 60, 3)] + [(past, 1) for past in range(61, 64)]
    for ring in (True, False):
        plan = run_case(seqs, 7, 4, 2, 2, head_dim, seed=3, ring=ring, use_native=use_native)
        if use_native and native.decode_kernel() is not None:
            assert plan.kernel is not None and plan.decode_starts is not None
        assert int(plan.decode_tables.shape[1]) <= (ring_blocks(1, 7, 4) + 1 if ring else 16)


def test_a_window_as_long_as_the_sequence_is_full_attention():
    """With W >= every position + 1 the window hides nothing: same result as the full-attention plan."""
    gen = torch.Generator().manual_seed(0)
    chunks = [
        SequenceChunk([0] * q, p, list(range(i * 8, i * 8 + 8))) for i, (p, q) in enumerate([(20, 1), (5, 6)])
    ]
    inputs = pack_step(chunks, 4)
    k_cache, v_cache = torch.randn(16, 4, 2, 16, generator=gen), torch.randn(16, 4, 2, 16, generator=gen)
    query = torch.randn(inputs.num_tokens, 4, 16, generator=gen)
    full = paged_attention(query, k_cache, v_cache, inputs, 0.25, plan_attention(inputs, k_cache))
    windowed = paged_attention(
        query, k_cache, v_cache, inputs, 0.25, plan_attention(inputs, k_cache, window=64)
    )
    torch.testing.assert_close(windowed, full, atol=1e-6, rtol=1e-6)


def test_a_plan_for_another_window_than_the_rings_is_refused():
    inputs = pack_step([SequenceChunk([1], 3, [0], window_ring=[0, 1])], 4, window=3)
    with pytest.raises(ValueError, match="rings are for window 3, the layer's is 5"):
        plan_attention(inputs, torch.zeros(2, 4, 1, 8), window=5)
