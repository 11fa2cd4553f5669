"""Triton paged-attention kernels: decode rows, varlen prefill blocks, the split-KV combine.

Why Triton: one kernel source compiles for CUDA and runs under Triton's interpreter on CPU-only machines, so
the same tests check it everywhere. Nothing here touches the host: every length, table and bound is loaded on
the device from the plan's tensors; the grids and constexprs come from the host plan. docs/performance.md,
"Module notes: ops and bench", has the rest.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _tanh(x):
    # tl has no tanh before libdevice; 1 - 2 / (e^2x + 1) is exact at both infinities.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _attend_keys(
    q,  # [M, D_PAD] DOT_DTYPE
    row_first,  # [M] int32: first key each row sees (inclusive)
    row_last,  # [M] int32: last key each row sees (inclusive)
    key_lo,  # first key of the loop
    key_hi,  # one past the last key of the loop
    table_ptr,  # this row's block table
    k_base,  # k_cache + kv_head * stride_kh
    v_base,
    stride_kb,
    stride_ks,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vd,
    scale,
    softcap,
    M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Online softmax of ``q`` over keys ``key_lo .. key_hi - 1``; returns unnormalised ``acc [M, D_PAD]``,
    the row sums ``l [M]`` and the row maxima ``m [M]`` (log2 domain, -inf for a row that saw nothing)."""
    dims = tl.arange(0, D_PAD)
    dim_ok = dims < HEAD_DIM
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D_PAD], tl.float32)
    for start in range(key_lo, key_hi, TILE):
        keys = start + tl.arange(0, TILE)  # [TILE]
        key_ok = keys < key_hi
        block = tl.load(table_ptr + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        offset = (keys % BLOCK_SIZE).to(tl.int64)
        k_ptrs = k_base + block[None, :] * stride_kb + offset[None, :] * stride_ks + dims[:, None] * stride_kd
        k = tl.load(k_ptrs, mask=dim_ok[:, None] & key_ok[None, :], other=0.0)  # [D_PAD, TILE]
        s = tl.dot(q, k.to(DOT_DTYPE), input_precision=PRECISION) * scale  # [M, TILE] float32
        if HAS_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        seen = (keys[None, :] >= row_first[:, None]) & (keys[None, :] <= row_last[:, None]) & key_ok[None, :]
        s = tl.where(seen, s * LOG2E, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # exp2(-inf - 0) = 0, never NaN
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])  # [M, TILE]
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = v_base + block[:, None] * stride_vb + offset[:, None] * stride_vs + dims[None, :] * stride_vd
        v = tl.load(v_ptrs, mask=key_ok[:, None] & dim_ok[None, :], other=0.0)  # [TILE, D_PAD]
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def paged_decode_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    token_rows_ptr,  # [E] int64: the flat token of each decode entry
    tables_ptr,  # [E, W] int32: the entry's block table (relative to its first readable position)
    kv_lens_ptr,  # [E] int32: keys through the entry's query, counted from its table start
    kv_starts_ptr,  # [E] int32: first attended key (sliding window); unused unless HAS_START
    part_acc_ptr,  # [E, Hq, NUM_SPLITS, HEAD_DIM] float32; unused when NUM_SPLITS == 1
    part_ml_ptr,  # [E, Hq, NUM_SPLITS, 2] float32: (max in log2 domain, sum)
    scale,
    softcap,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_table,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_START: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Grid ``(E, Hkv, NUM_SPLITS)``: one single-token entry (a decode row, or one token of a draft
    verification row), one kv head with its ``GROUP`` query heads, one slice of the keys."""
    entry = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    heads = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, D_PAD)
    head_ok = heads < GROUP
    dim_ok = dims < HEAD_DIM
    q_heads = kv_head * GROUP + heads  # [GROUP_PAD]
    token = tl.load(token_rows_ptr + entry).to(tl.int64)
    q_ptrs = q_ptr + token * stride_qt + q_heads[:, None] * stride_qh + dims[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=head_ok[:, None] & dim_ok[None, :], other=0.0).to(DOT_DTYPE)
    kv_len = tl.load(kv_lens_ptr + entry)
    if HAS_START:  # noqa: SIM108 (a constexpr branch, resolved when compiling)
        first = tl.load(kv_starts_ptr + entry)
    else:
        first = 0
    # Split s reads keys [lo, hi): equal whole tiles, the last split's shorter, trailing ones empty.
    per_split = tl.cdiv(tl.cdiv(kv_len - first, NUM_SPLITS), TILE) * TILE
    lo = first + split * per_split
    hi = tl.minimum(lo + per_split, kv_len)
    row_first = tl.zeros([GROUP_PAD], tl.int32) + first
    row_last = tl.zeros([GROUP_PAD], tl.int32) + kv_len - 1
    acc, l_i, m_i = _attend_keys(
        q,
        row_first,
        row_last,
        lo,
        hi,
        tables_ptr + entry.to(tl.int64) * stride_table,
        k_cache_ptr + kv_head * stride_kh,
        v_cache_ptr + kv_head * stride_vh,
        stride_kb,
        stride_ks,
        stride_kd,
        stride_vb,
        stride_vs,
        stride_vd,
        scale,
        softcap,
        GROUP_PAD,
        HEAD_DIM,
        D_PAD,
        BLOCK_SIZE,
        TILE,
        HAS_SOFTCAP,
        DOT_DTYPE,
        PRECISION,
    )
    keep = head_ok[:, None] & dim_ok[None, :]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + token * stride_ot + q_heads[:, None] * stride_oh + dims[None, :] * stride_od
        tl.store(o_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=keep)
    else:
        part = (
            entry.to(tl.int64) * (GROUP * tl.num_programs(1)) + q_heads
        ) * NUM_SPLITS + split  # [GROUP_PAD]
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=keep)
        tl.store(part_ml_ptr + part * 2, m_i, mask=head_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=head_ok)


@triton.jit
def combine_splits_kernel(
    out_ptr,
    token_rows_ptr,  # [E] int64
    part_acc_ptr,  # [E, Hq, NUM_SPLITS, HEAD_DIM] float32
    part_ml_ptr,  # [E, Hq, NUM_SPLITS, 2] float32
    stride_ot,
    stride_oh,
    stride_od,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
):
    """Grid ``(E, Hq)``: merge the split partial softmaxes of one entry and query head (flash-decoding)."""
    entry = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, D_PAD)
    split_ok = splits < NUM_SPLITS
    part = (entry.to(tl.int64) * tl.num_programs(1) + head) * NUM_SPLITS + splits  # [SPLITS_PAD]
    m = tl.load(part_ml_ptr + part * 2, mask=split_ok, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + part * 2 + 1, mask=split_ok, other=0.0)
    m_max = tl.max(m, 0)
    weight = tl.exp2(m - m_max)  # empty splits: exp2(-inf) = 0; the first split is never empty
    acc = tl.load(
        part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :],
        mask=split_ok[:, None] & (dims[None, :] < HEAD_DIM),
        other=0.0,
    )  # [SPLITS_PAD, D_PAD]
    total = tl.sum(acc * weight[:, None], 0) / tl.sum(l_s * weight, 0)  # [D_PAD]
    token = tl.load(token_rows_ptr + entry).to(tl.int64)
    o_ptrs = out_ptr + token * stride_ot + head * stride_oh + dims * stride_od
    tl.store(o_ptrs, total.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


@triton.jit
def paged_prefill_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    blocks_ptr,  # [NB, 4] int32 per query block: (prefill row, first flat token, query count, first key pos)
    tables_ptr,  # [P, W] int32: each prefill row's block table (relative to its first readable position)
    window,  # sliding window W (a query at p sees p - W + 1 .. p); unused unless HAS_WINDOW
    scale,
    softcap,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_table,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    SUB_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Grid ``(NB, Hkv, BLOCK_Q / SUB_Q)``: ``SUB_Q`` consecutive query tokens of one block of a multi-token
    row and the ``GROUP`` query heads of one kv head, flattened into ``SUB_Q * GROUP_PAD`` rows of one tile
    (a tile height that does not grow with the GQA group; programs past the block's count store nothing).

    The block's queries sit at key positions ``pos .. pos + count - 1`` of the row's table (its cached
    prefix is ``pos`` keys long for the first block); each sees keys ``0 .. its position`` (causal), or its
    last ``window`` of them. So a prefix-cache hit or a later chunk of a chunked prefill needs nothing else.
    """
    qblock = tl.program_id(0)
    kv_head = tl.program_id(1)
    first = tl.program_id(2) * SUB_Q  # this program's first query of the block
    row = tl.load(blocks_ptr + qblock * 4)
    token0 = tl.load(blocks_ptr + qblock * 4 + 1)
    count = tl.load(blocks_ptr + qblock * 4 + 2)
    pos0 = tl.load(blocks_ptr + qblock * 4 + 3)
    rows = tl.arange(0, SUB_Q * GROUP_PAD)
    local = first + rows // GROUP_PAD
    query = tl.minimum(local, count - 1)  # padded token rows repeat the last query: no NaN
    head = rows % GROUP_PAD
    row_ok = (local < count) & (head < GROUP)
    dims = tl.arange(0, D_PAD)
    dim_ok = dims < HEAD_DIM
    tokens = (token0 + query).to(tl.int64)
    q_heads = kv_head * GROUP + head
    q_ptrs = q_ptr + tokens[:, None] * stride_qt + q_heads[:, None] * stride_qh + dims[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=(head < GROUP)[:, None] & dim_ok[None, :], other=0.0).to(DOT_DTYPE)
    row_last = pos0 + query  # [M] the query's own key
    if HAS_WINDOW:
        row_first = tl.maximum(row_last - window + 1, 0)
        key_lo = tl.maximum(pos0 + first - window + 1, 0)
    else:
        row_first = tl.zeros([SUB_Q * GROUP_PAD], tl.int32)
        key_lo = 0
    # Through this program's last query; no keys at all when the block has no query here.
    key_hi = tl.where(first < count, pos0 + tl.minimum(count, first + SUB_Q), key_lo)
    acc, l_i, m_i = _attend_keys(
        q,
        row_first,
        row_last,
        key_lo,
        key_hi,
        tables_ptr + row.to(tl.int64) * stride_table,
        k_cache_ptr + kv_head * stride_kh,
        v_cache_ptr + kv_head * stride_vh,
        stride_kb,
        stride_ks,
        stride_kd,
        stride_vb,
        stride_vs,
        stride_vd,
        scale,
        softcap,
        SUB_Q * GROUP_PAD,
        HEAD_DIM,
        D_PAD,
        BLOCK_SIZE,
        TILE,
        HAS_SOFTCAP,
        DOT_DTYPE,
        PRECISION,
    )
    l_i = tl.where(l_i > 0.0, l_i, 1.0)  # a program without queries computed nothing and stores nothing
    o_ptrs = out_ptr + tokens[:, None] * stride_ot + q_heads[:, None] * stride_oh + dims[None, :] * stride_od
    out = (acc / l_i[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(o_ptrs, out, mask=row_ok[:, None] & dim_ok[None, :])
