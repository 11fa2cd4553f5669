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

from pagedgen.core.window_geometry import ring_blocks
from pagedgen.executor.inputs import SequenceChunk, pack_step
from pagedgen.ops.kernels import native
from pagedgen.ops.mixers.attention import paged_attention, plan_attention
from tests.helpers.window_attention import run_case


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


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
