"""Sliding-window attention cases: rings filled as the engine fills them, checked against dense attention.

:func:`run_case` writes each sequence's history in order (a ring overwrites its oldest positions), runs paged
attention over rings or plain block tables, and compares every query with :func:`dense_window_attention`
over its last ``window`` keys; the windowed-attention suites of every backend build their cases with it.
"""

from __future__ import annotations

import torch

from pagedgen.core.window_geometry import ring_blocks, ring_slot
from pagedgen.executor.inputs import SequenceChunk, pack_step
from pagedgen.ops.mixers.attention import paged_attention, plan_attention, write_kv


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
