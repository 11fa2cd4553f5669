"""Paged attention over packed variable-length steps: the K/V write, a pure-torch oracle, the fast CPU path.

A step's queries are the concatenated new tokens of B requests (``StepInputs``). Request ``i``'s keys live in
the paged cache at logical positions ``[0, past_i + q_i)``: logical position ``p`` sits in physical block
``block_tables[i, p // block_size]`` at offset ``p % block_size``. The model first writes the step's new K/V
with :func:`write_kv` (through ``slot_mapping``), then attends with :func:`paged_attention`; the query token
at absolute position ``p`` sees keys ``0..p`` (causal). Grouped-query attention: query head ``h`` reads kv
head ``h // (Hq // Hkv)``.

:func:`paged_attention_reference` is the obviously-correct oracle (one request, one query token at a time in
float32); :func:`paged_attention` is what models call. The fast path batches every single-token (decode) row
into one masked SDPA over their gathered blocks, and runs one causal SDPA per multi-token (prefill / draft)
row, so the Python loop is over requests, never over tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedgen.executor.inputs import StepInputs


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store the step's new ``key``/``value`` ``[T, Hkv, D]`` at their flat cache slots.

    Mutates ``k_cache`` and ``v_cache`` ``[num_blocks, block_size, Hkv, D]`` in place (cast to the cache
    dtype). ``slot_mapping [T]`` holds ``block * block_size + offset``. Raises ``ValueError`` on a shape
    mismatch, before anything is written.
    """
    _check_kv_shapes(key, value, k_cache, v_cache)
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping must be [T={key.shape[0]}], got shape {tuple(slot_mapping.shape)}")
    heads, dim = k_cache.shape[2], k_cache.shape[3]
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.long)
    k_cache.view(-1, heads, dim).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, heads, dim).index_copy_(0, slots, value.to(v_cache.dtype))


def paged_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    inputs: StepInputs,
    scale: float,
) -> torch.Tensor:
    """The oracle: per request, gather positions one by one through the block table, attend in float32.

    ``query [T, Hq, D]``; returns ``[T, Hq, D]`` in ``query.dtype``. Deliberately slow and literal.
    """
    _check_query(query, k_cache, inputs)
    block_size = inputs.block_size
    groups = query.shape[1] // k_cache.shape[2]
    out = torch.empty_like(query)
    cu = inputs.cu_seqlens.tolist()
    past = inputs.past_lens.tolist()
    tables = inputs.block_tables.tolist()
    for i in range(inputs.num_seqs):
        kv_len = past[i] + cu[i + 1] - cu[i]
        blocks = [tables[i][p // block_size] for p in range(kv_len)]
        offsets = [p % block_size for p in range(kv_len)]
        keys = k_cache[blocks, offsets].float().repeat_interleave(groups, dim=1)  # [kv_len, Hq, D]
        values = v_cache[blocks, offsets].float().repeat_interleave(groups, dim=1)  # [kv_len, Hq, D]
        for j in range(cu[i], cu[i + 1]):
            seen = past[i] + (j - cu[i]) + 1  # this token's absolute position + 1
            q = query[j].float()  # [Hq, D]
            scores = torch.einsum("hd,khd->hk", q, keys[:seen]) * scale  # [Hq, seen]
            probs = torch.softmax(scores, dim=-1)
            out[j] = torch.einsum("hk,khd->hd", probs, values[:seen]).to(query.dtype)
    return out


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    inputs: StepInputs,
    scale: float,
) -> torch.Tensor:
    """Causal GQA attention of every request of the step over its paged history (new K/V already written).

    ``query [T, Hq, D]``; returns ``[T, Hq, D]`` in ``query.dtype``. Reads only; raises ``ValueError`` on
    inconsistent shapes.
    """
    _check_query(query, k_cache, inputs)
    out = torch.empty_like(query)  # [T, Hq, D]
    q_lens = inputs.query_lens.tolist()
    for rows, width in _decode_buckets(q_lens, inputs.kv_lens.tolist(), inputs.block_size):
        _decode_rows(query, k_cache, v_cache, inputs, scale, rows, width, out)
    if any(n > 1 for n in q_lens):
        _prefill_rows(query, k_cache, v_cache, inputs, scale, q_lens, out)
    return out


def _decode_buckets(q_lens: list[int], kv_lens: list[int], block_size: int) -> list[tuple[list[int], int]]:
    """Group single-token rows by the power-of-two bucket of their block count: ``[(rows, max_width)]``.

    One gather pads every row to the bucket's widest table, so a long request padded no short row more than
    twice over; a step has at most log2(max blocks) + 1 buckets, usually one.
    """
    rows_of: dict[int, list[int]] = {}
    widest: dict[int, int] = {}
    for row, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
        if q_len != 1:
            continue
        width = -(-kv_len // block_size)
        bucket = (width - 1).bit_length()
        rows_of.setdefault(bucket, []).append(row)
        widest[bucket] = max(widest.get(bucket, 0), width)
    return [(rows, widest[bucket]) for bucket, rows in rows_of.items()]


def _decode_rows(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    inputs: StepInputs,
    scale: float,
    row_ids: list[int],
    width: int,
    out: torch.Tensor,
) -> None:
    """One masked SDPA over single-token rows: gather ``width`` blocks each, mask keys past each row's end."""
    block_size = inputs.block_size
    device = k_cache.device
    rows = torch.tensor(row_ids, dtype=torch.long, device=device)  # [B_dec]
    kv_lens = inputs.kv_lens.to(device).long()[rows]  # [B_dec]
    token_rows = inputs.cu_seqlens.to(device).long()[rows]  # [B_dec], the row's only token
    tables = inputs.block_tables.to(device).long()[rows, :width]  # [B_dec, width]
    heads, dim = k_cache.shape[2], k_cache.shape[3]
    span = width * block_size
    flat_tables = tables.reshape(-1)  # [B_dec * width]; index_select is far cheaper than advanced indexing
    keys = k_cache.index_select(0, flat_tables).view(rows.shape[0], span, heads, dim).transpose(1, 2)
    values = v_cache.index_select(0, flat_tables).view(rows.shape[0], span, heads, dim).transpose(1, 2)
    # keys, values: [B_dec, Hkv, span, D] (strided views; SDPA reads them without a copy)
    mask = torch.arange(span, device=device) < kv_lens.unsqueeze(1)  # [B_dec, span]
    q = query[token_rows].unsqueeze(2)  # [B_dec, Hq, 1, D]
    attn = F.scaled_dot_product_attention(
        q,
        keys.to(q.dtype),
        values.to(q.dtype),
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )  # [B_dec, Hq, 1, D]
    out[token_rows] = attn.squeeze(2)


def _prefill_rows(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    inputs: StepInputs,
    scale: float,
    q_lens: list[int],
    out: torch.Tensor,
) -> None:
    """One causal SDPA per multi-token row over its past + new keys (a loop over requests, not tokens)."""
    block_size = inputs.block_size
    device = k_cache.device
    heads, dim = k_cache.shape[2], k_cache.shape[3]
    cu = inputs.cu_seqlens.tolist()
    past = inputs.past_lens.tolist()
    tables = inputs.block_tables.to(device).long()  # [B, W]
    for i, q_len in enumerate(q_lens):
        if q_len == 1:
            continue
        kv_len = past[i] + q_len
        width = -(-kv_len // block_size)
        blocks = tables[i, :width]  # [width]
        keys = (
            k_cache.index_select(0, blocks).view(-1, heads, dim)[:kv_len].transpose(0, 1)
        )  # [Hkv, kv_len, D]
        values = (
            v_cache.index_select(0, blocks).view(-1, heads, dim)[:kv_len].transpose(0, 1)
        )  # [Hkv, kv_len, D]
        q = query[cu[i] : cu[i + 1]].transpose(0, 1)  # [Hq, q_len, D]
        if past[i] == 0:
            mask, causal = None, True
        else:
            # Query j (absolute position past + j) sees keys 0..past + j.
            key_pos = torch.arange(kv_len, device=device)
            query_pos = torch.arange(past[i], kv_len, device=device)
            mask, causal = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1), False  # [q_len, kv_len]
        attn = F.scaled_dot_product_attention(
            q,
            keys.to(q.dtype),
            values.to(q.dtype),
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=True,
        )  # [Hq, q_len, D]
        out[cu[i] : cu[i + 1]] = attn.transpose(0, 1)


def _check_kv_shapes(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache/v_cache must both be [num_blocks, block_size, Hkv, D], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    want = (key.shape[0], k_cache.shape[2], k_cache.shape[3])
    if key.dim() != 3 or tuple(key.shape) != want or tuple(value.shape) != want:
        raise ValueError(
            f"key/value must be [T, Hkv, D] = {list(want)}, got {tuple(key.shape)} and {tuple(value.shape)}"
        )


def _check_query(query: torch.Tensor, k_cache: torch.Tensor, inputs: StepInputs) -> None:
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [num_blocks, block_size, Hkv, D], got {tuple(k_cache.shape)}")
    if k_cache.shape[1] != inputs.block_size:
        raise ValueError(
            f"cache block_size {k_cache.shape[1]} differs from the step's block_size {inputs.block_size}"
        )
    if query.dim() != 3 or query.shape[0] != inputs.num_tokens or query.shape[2] != k_cache.shape[3]:
        raise ValueError(
            f"query must be [T={inputs.num_tokens}, Hq, D={k_cache.shape[3]}], got {tuple(query.shape)}"
        )
    if query.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"query heads {query.shape[1]} must be a multiple of kv heads {k_cache.shape[2]}")
