"""Paged attention over packed variable-length steps: the K/V write, a pure-torch oracle, the fast CPU path.

Why a plan and an oracle: the plan is built once per step and shared by every layer, so a layer pays for its
kernels alone; the oracle (one request, one query token at a time, in float32) is what every fast path is
tested against. Decode rows go to the native kernel, which reads the blocks in place, prefill rows to one
causal SDPA each, and CUDA steps to the Triton kernels. docs/performance.md, "Module notes: ops and bench",
has the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedgen.core.step_inputs import StepInputs
from pagedgen.ops.kernels.native import DecodeKernel, decode_kernel
from pagedgen.ops.mixers.triton_attention import (
    TritonPlan,
    decode_splits,
    prefill_work,
    triton_paged_attention,
    triton_selected,
)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    host_slots: torch.Tensor | None = None,
) -> None:
    """Store the step's new ``key``/``value`` ``[T, Hkv, D]`` at their flat cache slots.

    Mutates ``k_cache`` and ``v_cache`` ``[num_blocks, block_size, Hkv, D]`` in place (cast to the cache
    dtype). ``slot_mapping [T]`` holds ``block * block_size + offset``. Raises ``ValueError`` on a shape
    mismatch and ``IndexError`` for a slot outside the cache, both before anything is written.

    The bounds are checked on ``host_slots``, the host copy of ``slot_mapping`` (``AttentionPlan``'s
    ``host_slot_mapping``), else on ``slot_mapping`` itself when it is on the CPU. Slots on another device
    with no host copy are not read back (that would be two host synchronisations per layer per step); an
    engine step's are also checked once before the model runs (:func:`check_step_slots`, by the runner).
    """
    _check_kv_shapes(key, value, k_cache, v_cache)
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping must be [T={key.shape[0]}], got shape {tuple(slot_mapping.shape)}")
    heads, dim = k_cache.shape[2], k_cache.shape[3]
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.long)
    kernel = decode_kernel()
    if kernel is not None and _native_writable(key, value, k_cache, v_cache, slots):
        kernel.write_kv(key, value, k_cache, v_cache, slots)  # one call instead of two index_copy_
        return
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    bounds = host_slots if host_slots is not None else slots if slots.device.type == "cpu" else None
    if bounds is not None and bounds.numel() and (int(bounds.min()) < 0 or int(bounds.max()) >= num_slots):
        # index_copy_ would raise only after writing the rows before the bad one
        raise IndexError(f"write_kv: a slot of {bounds.tolist()} is outside the cache's {num_slots} slots")
    k_cache.view(-1, heads, dim).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, heads, dim).index_copy_(0, slots, value.to(v_cache.dtype))


def check_step_slots(inputs: StepInputs, full_slots: int, window_slots: int | None = None) -> None:
    """Refuse a packed step whose host slot copies (``inputs.host``) leave the cache, before anything runs.

    ``full_slots`` is the slot count of the full-attention layers' cache (blocks x block_size),
    ``window_slots`` that of the window-ring pool when the sliding-window layers keep rings (their slots are
    ``inputs.window.slot_mapping``). Raises ``IndexError`` naming the slots. Reads host tensors only, so a
    device step is checked without a synchronisation; inputs without host copies are left to
    :func:`write_kv`.
    """
    host = inputs.host
    if host is None:
        return
    checks = [(host.slot_mapping, full_slots, "")]
    if window_slots is not None and host.window_slot_mapping is not None:
        checks.append((host.window_slot_mapping, window_slots, "window-ring "))
    for slots, num_slots, kind in checks:
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= num_slots):
            raise IndexError(
                f"write_kv: a {kind}slot of {slots.tolist()} is outside the cache's {num_slots} slots"
            )


def _native_writable(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> bool:
    """fp32 CPU tensors whose rows the kernel can copy as runs: packed heads/dims, contiguous caches."""
    tensors = (key, value, k_cache, v_cache)
    return (
        all(t.dtype is torch.float32 and t.device.type == "cpu" for t in tensors)
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (key, value))
        and slots.is_contiguous()
    )


def paged_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    inputs: StepInputs,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """The oracle: per request, gather positions one by one through the block table, attend in float32.

    ``query [T, Hq, D]``; returns ``[T, Hq, D]`` in ``query.dtype``. Deliberately slow and literal.
    ``softcap`` squashes each score to ``softcap * tanh(score / softcap)`` before the softmax (Gemma 2).
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
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            probs = torch.softmax(scores, dim=-1)
            out[j] = torch.einsum("hk,khd->hd", probs, values[:seen]).to(query.dtype)
    return out


@dataclass(slots=True)
class DecodeBucket:
    """Single-token rows gathered together by the pure-torch path (padded to ``width`` blocks)."""

    token_rows: torch.Tensor  # [n] int64, the rows' tokens in the flat step
    flat_tables: torch.Tensor  # [n * width] int64, each row's first ``width`` blocks
    mask: torch.Tensor  # [n, 1, 1, width * block_size] bool, the keys each row attends to
    width: int


@dataclass(slots=True)
class PrefillRow:
    """One multi-token row (prefill chunk or draft): its tokens, blocks and causal mask."""

    start: int  # first token in the flat step
    end: int  # one past its last token
    kv_len: int  # keys gathered: from the row's first read position through its last query
    blocks: torch.Tensor  # [ceil(kv_len / block_size)] int64
    mask: torch.Tensor | None  # [q_len, kv_len] bool; None when the row starts at position 0 (plain causal)


@dataclass(slots=True)
class AttentionPlan:
    """A step's attention metadata, derived once from :class:`StepInputs` and shared by every layer.

    Why: the lists, index tensors and masks below cost tens of microseconds each to build; a 30-layer model
    built them 30 times per step before. ``kernel`` is the native decode kernel when it can read this cache.
    A sliding-window plan (``window`` set) reads each row from its first live block on (``decode_starts``:
    the first attended key, relative to the row's table) and writes through ``slot_mapping`` (the ring's
    slots when the window layers keep rings).
    """

    block_size: int
    decode_token_rows: torch.Tensor  # [Bd] int64, tokens of the single-token rows
    decode_tables: torch.Tensor  # [Bd, W] int32, contiguous
    decode_kv_lens: torch.Tensor  # [Bd] int32, keys through the row's query, counted from its table start
    decode_buckets: list[DecodeBucket] | None  # the pure-torch decode path (None when ``kernel`` is set,
    # except in a static decode plan, :func:`_plan_one_token_rows`, which always has its one device bucket)
    prefill: list[PrefillRow]
    kernel: DecodeKernel | None
    slot_mapping: torch.Tensor | None = None  # [T] int64 where this plan's layers write (None: inputs')
    host_slot_mapping: torch.Tensor | None = None  # [T] int64 host copy of those slots (None: no host copy)
    decode_starts: torch.Tensor | None = None  # [Bd] int32 first attended key; None: 0 (full attention)
    window: int | None = None
    triton: TritonPlan | None = (
        None  # set when the Triton kernels serve the step (then no buckets, no prefill)
    )


@dataclass(slots=True)
class _KeyView:
    """Where each row's keys are read from: ``tables[i, k]`` holds logical block ``first_pos[i] / B + k``."""

    tables: torch.Tensor  # [B, W] int32
    first_pos: list[int]  # [B] logical position of column 0
    slot_mapping: torch.Tensor  # [T] int64


@dataclass(slots=True)
class _HostLengths:
    """The step's lengths as host lists, read with one device-to-host copy (a plain read on the CPU)."""

    cu: list[int]  # [B+1]
    past: list[int]  # [B]
    ring_first_pos: list[int] | None  # [B] the window rings' first positions, when the plan reads rings

    @property
    def q_lens(self) -> list[int]:
        return [b - a for a, b in zip(self.cu, self.cu[1:], strict=False)]


def _host_lengths(inputs: StepInputs, window: int | None) -> _HostLengths:
    """Why one read: on CUDA every ``.tolist()`` of a device tensor is a stream synchronisation. Packed
    steps carry the host copies their device tensors came from (``inputs.host``, the rings' first positions
    included): they are read instead, and the plan needs no device read at all. Inputs built elsewhere are
    read from their tensors, once."""
    rings = window is not None and inputs.window is not None
    host = inputs.host
    if host is not None and (not rings or host.window_first_pos is not None):
        ring_first_pos = host.window_first_pos.tolist() if rings else None
        return _HostLengths(host.cu_seqlens.tolist(), host.past_lens.tolist(), ring_first_pos)
    parts = [inputs.cu_seqlens, inputs.past_lens]
    if rings:
        parts.append(inputs.window.first_pos)
    flat = torch.cat([t.to(torch.int64) for t in parts]).tolist()
    b = inputs.num_seqs
    return _HostLengths(flat[: b + 1], flat[b + 1 : 2 * b + 1], flat[2 * b + 1 :] if rings else None)


def _host_slots(inputs: StepInputs, window: int | None) -> torch.Tensor | None:
    """The host copy of the slots a plan's layers write (the rings' when a window plan reads rings)."""
    if inputs.host is None:
        return None
    if window is not None and inputs.window is not None:
        return inputs.host.window_slot_mapping
    return inputs.host.slot_mapping


def _upload(device: torch.device, *lists: list[int]) -> list[torch.Tensor]:
    """The plan's small index tensors (int64) in one host-to-device copy, pinned and asynchronous on CUDA, so
    building a plan never waits for the stream."""
    flat = torch.tensor([v for values in lists for v in values], dtype=torch.long)
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    elif flat.device != device:
        flat = flat.to(device)
    return list(flat.split([len(values) for values in lists]))


def _full_view(inputs: StepInputs) -> _KeyView:
    return _KeyView(inputs.block_tables, [0] * inputs.num_seqs, inputs.slot_mapping)


def _window_view(inputs: StepInputs, window: int, host: _HostLengths) -> _KeyView:
    """The ring's rotated tables, or (layers stored like full ones) the block tables from each row's first
    live block on, so old blocks are neither gathered nor scored."""
    if inputs.window is not None:
        if inputs.window.size != window:
            raise ValueError(
                f"the step's window rings are for window {inputs.window.size}, the layer's is {window}"
            )
        ring = inputs.window
        assert host.ring_first_pos is not None
        return _KeyView(ring.block_tables, host.ring_first_pos, ring.slot_mapping)
    bs = inputs.block_size
    first_block = (inputs.past_lens.long() - window + 1).clamp(min=0) // bs  # [B], on the tables' device
    tables = inputs.block_tables
    steps = torch.arange(tables.shape[1], device=tables.device)
    columns = (first_block.to(tables.device)[:, None] + steps[None, :]).clamp(max=tables.shape[1] - 1)
    first_pos = [max(0, past - window + 1) // bs * bs for past in host.past]  # the same, on the host
    return _KeyView(tables.gather(1, columns).to(torch.int32), first_pos, inputs.slot_mapping)


def plan_attention(
    inputs: StepInputs, k_cache: torch.Tensor, use_native: bool = True, window: int | None = None
) -> AttentionPlan:
    """Build the step's :class:`AttentionPlan` for caches like ``k_cache`` (any layer's; they share a layout).

    The tokens of draft-verification rows (``inputs.verify_rows``) are planned as decodes of their own, each
    over the keys through its position, not as a prefill SDPA: a step of decodes and drafts then stays a pure
    decode step (the native kernel, the fused decoder), and each draft row attends exactly as the decode of
    that position would.

    ``use_native=False`` forces the pure-torch decode path on the CPU (tests and benchmarks compare the two).
    ``window`` plans for sliding-window layers: a query at ``p`` sees keys ``p - window + 1 .. p``, read
    from the step's rings (``inputs.window``) when it has them, else from the block tables.
    When :func:`~pagedgen.ops.mixers.triton_attention.triton_selected` picks the Triton kernels for this
    cache's device, the plan carries their work lists (``triton``) and neither torch buckets nor prefill
    masks.

    Host traffic: the step's lengths are read once (:func:`_host_lengths`) and the plan's index tensors
    written once (:func:`_upload`); every other list is host arithmetic. A pure decode step without host
    copies (a CUDA graph's static inputs) is planned by :func:`_plan_one_token_rows` with neither, and a
    plain CPU decode step on the native kernel by :func:`_plan_plain_decode` from its own tensors.
    """
    device = k_cache.device
    if _static_decode(inputs, window):
        return _plan_one_token_rows(inputs, k_cache, use_native, window, host=False)
    if use_native and window is None and _plain_decode(inputs) and device.type == "cpu":
        plan = _plan_plain_decode(inputs, k_cache)
        if plan is not None:
            return plan
    return _plan_general(inputs, k_cache, use_native, window)


def _plan_general(
    inputs: StepInputs, k_cache: torch.Tensor, use_native: bool, window: int | None
) -> AttentionPlan:
    """Any step with host copies (or read from its tensors once): decodes, drafts, prefills, windows."""
    device = k_cache.device
    host = _host_lengths(inputs, window)
    q_lens, cu, past = host.q_lens, host.cu, host.past
    view = _full_view(inputs) if window is None else _window_view(inputs, window, host)
    verify = set(inputs.verify_rows)
    decode_rows = [i for i, n in enumerate(q_lens) if n == 1 or i in verify]
    use_triton = triton_selected(device)
    kernel = decode_kernel() if use_native and decode_rows and not use_triton else None
    if kernel is not None and not kernel.supports(k_cache, k_cache, k_cache):
        kernel = None
    # One decode entry per token: a verification row's token j sees the keys through its own position.
    owner = [i for i in decode_rows for _ in range(q_lens[i])]  # the row of each entry
    ends = [past[i] + 1 + j for i in decode_rows for j in range(q_lens[i])]  # keys seen
    rel_lens = [end - view.first_pos[i] for i, end in zip(owner, ends, strict=True)]
    starts = None
    if window is not None:
        starts = [max(0, end - window) - view.first_pos[i] for i, end in zip(owner, ends, strict=True)]
    token_rows = [cu[i] + j for i in decode_rows for j in range(q_lens[i])]
    work, prefill_ids = (
        prefill_work(q_lens, past, cu, view.first_pos, set(decode_rows)) if use_triton else ([], [])
    )
    uploaded = _upload(device, token_rows, owner, rel_lens, starts or [], work, prefill_ids)
    token_rows_t, owner_t, rel_lens_t, starts_t, work_t, prefill_ids_t = uploaded
    tables = view.tables.index_select(0, owner_t.to(view.tables.device)).to(device, torch.int32).contiguous()
    triton = None
    if use_triton:
        triton = TritonPlan(
            decode_entries=len(owner),
            num_splits=decode_splits(len(owner) * k_cache.shape[2], max(rel_lens, default=0), device),
            prefill_blocks=work_t.to(torch.int32).view(-1, 4),
            prefill_tables=view.tables.index_select(0, prefill_ids_t.to(view.tables.device))
            .to(device, torch.int32)
            .contiguous(),
            window=window,
        )
    return AttentionPlan(
        block_size=inputs.block_size,
        decode_token_rows=token_rows_t,
        decode_tables=tables,
        decode_kv_lens=rel_lens_t.to(torch.int32),
        decode_buckets=None
        if kernel is not None or use_triton
        else _decode_buckets(token_rows_t, tables, rel_lens, starts, inputs.block_size),
        prefill=[] if use_triton else _prefill_rows(inputs, host, view, window, device, verify),
        kernel=kernel,
        slot_mapping=view.slot_mapping,
        host_slot_mapping=_host_slots(inputs, window),
        decode_starts=None if starts is None else starts_t.to(torch.int32),
        window=window,
        triton=triton,
    )


def _plain_decode(inputs: StepInputs) -> bool:
    """Whether every row of a packed step (host copies present) sends exactly one token and verifies no
    draft: then decode entry ``i`` is token row ``i`` and the step has no prefill rows."""
    return (
        inputs.host is not None
        and inputs.max_query_len == 1
        and inputs.num_tokens == inputs.num_seqs
        and not inputs.verify_rows
    )


def _plan_plain_decode(inputs: StepInputs, k_cache: torch.Tensor) -> AttentionPlan | None:
    """The full-attention plan of a plain CPU decode step on the native kernel, built from the step's own
    tensors; ``None`` when the native kernel does not serve it (the general path then plans it).

    Why: at batch 1 the general path's host lists, upload, ``index_select`` and prefill scan cost about
    0.3 ms a step (docs/performance.md, "Host cost at batch 1, second pass") to produce what a plain decode
    step already holds: entry ``i`` is token row ``i``, its table is the step's row ``i`` and its key count
    ``past_lens[i] + 1``. Every field equals the general path's (``tests/unit/test_attention_plan.py``);
    the tables may share the step's memory instead of being a copy (the plan only reads them).
    """
    if triton_selected(k_cache.device) or not inputs.num_seqs:
        return None
    assert inputs.host is not None  # _plain_decode
    plan = _plan_one_token_rows(inputs, k_cache, use_native=True, window=None, host=True)
    return plan if plan.kernel is not None else None


def _static_decode(inputs: StepInputs, window: int | None) -> bool:
    """Whether the step is a pure decode step with no host copies, known from shapes and static metadata:
    a captured CUDA graph's static inputs (``pagedgen.executor.cuda_graphs``), planned by
    :func:`_plan_one_token_rows` without reading a device value."""
    return (
        inputs.host is None
        and inputs.max_query_len == 1
        and inputs.num_tokens == inputs.num_seqs  # every row sends exactly one token: token row i is row i
        and not inputs.verify_rows
        and (window is None or inputs.window is None)  # rings are planned from their host first positions
    )


def _plan_one_token_rows(
    inputs: StepInputs, k_cache: torch.Tensor, use_native: bool, window: int | None, *, host: bool
) -> AttentionPlan:
    """The plan of a pure decode step built from shapes, static metadata and device tensor ops only: the
    static decode plan (``host=False``), and with ``host=True`` the plain CPU decode plan
    (:func:`_plan_plain_decode`), which keeps the step's host slots and builds no torch bucket (only the
    native kernel serves it).

    Why: a captured CUDA graph's static inputs carry no host copies; reading their lengths (``.tolist()``)
    would synchronise, which capture refuses, and per-step index lists uploaded from the host would be baked
    into the graph. Here decode entry ``i`` is token row ``i``, its table is the step's table row (the
    static view itself for full attention), its key count ``past_lens + 1`` is computed on the device, and
    the Triton split count is derived from ``max_kv_len`` (the bucket's capacity for a graph), so it is the
    same for every replay. A sliding-window layer (tables, not rings) computes each row's first live block
    and first attended key on the device too.
    """
    device = k_cache.device
    rows = inputs.num_seqs
    bs = inputs.block_size
    kv_lens = inputs.past_lens.to(device, torch.int64) + 1  # [B] keys through the row's one query
    token_rows = torch.arange(rows, dtype=torch.long, device=device)  # [B]
    starts = None
    bound = inputs.max_kv_len  # keys any row can read: the split count is a function of it only
    if window is None:
        tables = inputs.block_tables.to(device, torch.int32).contiguous()
        rel_lens = kv_lens
    else:
        first_block = (kv_lens - window).clamp(min=0) // bs  # [B] the block of the first attended key
        width = inputs.block_tables.shape[1]
        steps = torch.arange(width, device=device)
        columns = (first_block[:, None] + steps[None, :]).clamp(max=width - 1)
        tables = inputs.block_tables.to(device).gather(1, columns).to(torch.int32).contiguous()
        first_pos = first_block * bs
        rel_lens = kv_lens - first_pos
        starts = ((kv_lens - window).clamp(min=0) - first_pos).to(torch.int32)
        bound = min(bound, window + bs - 1)  # at most window keys, from the start of their first block
    use_triton = triton_selected(device)
    kernel = decode_kernel() if use_native and rows and not use_triton else None
    if kernel is not None and not kernel.supports(k_cache, k_cache, k_cache):
        kernel = None
    triton = None
    if use_triton:
        triton = TritonPlan(
            decode_entries=rows,
            num_splits=decode_splits(rows * k_cache.shape[2], bound, device),
            prefill_blocks=torch.empty(0, 4, dtype=torch.int32, device=device),
            prefill_tables=torch.empty(0, tables.shape[1], dtype=torch.int32, device=device),
            window=window,
        )
    rel_lens = rel_lens.to(torch.int32)
    return AttentionPlan(
        block_size=bs,
        decode_token_rows=token_rows,
        decode_tables=tables,
        decode_kv_lens=rel_lens,
        # The torch path's one bucket (the table's full width, masked on the device); also the fallback
        # when the native kernel cannot take the call's tensors (soft-capping), which would read lengths.
        decode_buckets=None
        if use_triton or host
        else [_device_bucket(token_rows, tables, rel_lens, starts, bs)],
        prefill=[],
        kernel=kernel,
        slot_mapping=inputs.slot_mapping,
        host_slot_mapping=inputs.host.slot_mapping if host and inputs.host is not None else None,
        decode_starts=starts,
        window=window,
        triton=triton,
    )


def _device_bucket(
    token_rows: torch.Tensor,
    tables: torch.Tensor,
    kv_lens: torch.Tensor,
    starts: torch.Tensor | None,
    block_size: int,
) -> DecodeBucket:
    """Every single-token row in one bucket as wide as the tables, its mask built from device lengths
    (keys ``starts[r] .. kv_lens[r] - 1``): no host read, at the cost of padding short rows to the width."""
    width = tables.shape[1]
    keys = torch.arange(width * block_size, device=tables.device)  # [span]
    mask = keys < kv_lens.to(tables.device).unsqueeze(1)  # [B, span]
    if starts is not None:
        mask &= keys >= starts.to(tables.device).unsqueeze(1)
    return DecodeBucket(
        token_rows=token_rows,
        flat_tables=tables.long().reshape(-1),
        mask=mask[:, None, None, :],
        width=width,
    )


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    inputs: StepInputs,
    scale: float,
    plan: AttentionPlan | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal GQA attention of every request of the step over its paged history (new K/V already written).

    ``query [T, Hq, D]``; returns ``[T, Hq, D]`` in ``query.dtype``. Reads only; raises ``ValueError`` on
    inconsistent shapes. ``plan`` is the step's :func:`plan_attention` (built here when omitted; a
    sliding-window layer must pass its window plan). ``softcap`` (Gemma 2's attention logit soft-capping)
    makes the scores ``softcap * tanh(scores / softcap)`` before the mask and softmax; neither the native
    decode kernel nor SDPA does that, so those rows take the explicit torch path (:func:`_attend`). A
    Triton plan (``plan.triton``) runs every row on the Triton kernels, soft-capped or not, with no host
    read of a device value.
    """
    _check_query(query, k_cache, inputs)
    plan = plan_attention(inputs, k_cache) if plan is None else plan
    out = torch.empty_like(query)  # [T, Hq, D]
    if plan.triton is not None:
        triton_paged_attention(
            query,
            k_cache,
            v_cache,
            plan.decode_token_rows,
            plan.decode_tables,
            plan.decode_kv_lens,
            plan.decode_starts,
            plan.triton,
            scale,
            softcap,
            out,
        )
        return out
    kernel = plan.kernel
    if kernel is not None:
        query = query.contiguous()  # q may be a view into the fused q/k/v product
    if kernel is not None and softcap is None and kernel.supports(query, k_cache, v_cache):
        kernel(
            query,
            k_cache,
            v_cache,
            plan.decode_tables,
            plan.decode_kv_lens,
            plan.decode_token_rows,
            scale,
            out,
            kv_starts=plan.decode_starts,
        )
    else:
        buckets = plan.decode_buckets
        if buckets is None:  # planned for the kernel, but these tensors need the torch path
            starts = None if plan.decode_starts is None else plan.decode_starts.tolist()
            buckets = _decode_buckets(
                plan.decode_token_rows,
                plan.decode_tables,
                plan.decode_kv_lens.tolist(),
                starts,
                plan.block_size,
            )
        for bucket in buckets:
            _decode_bucket(query, k_cache, v_cache, bucket, scale, out, softcap)
    for row in plan.prefill:
        _prefill_row(query, k_cache, v_cache, row, scale, out, softcap)
    return out


def _decode_buckets(
    token_rows: torch.Tensor,
    tables: torch.Tensor,
    kv_lens: list[int],
    starts: list[int] | None,
    block_size: int,
) -> list[DecodeBucket]:
    """Group single-token rows by the power-of-two bucket of their block count.

    One gather pads every row to the bucket's widest table, so a long request padded no short row more than
    twice over; a step has at most log2(max blocks) + 1 buckets, usually one. A row attends to keys
    ``starts[r] .. kv_lens[r] - 1`` of its table (from 0 when ``starts`` is None).
    """
    device = tables.device
    rows_of: dict[int, list[int]] = {}
    widest: dict[int, int] = {}
    for row, kv_len in enumerate(kv_lens):
        width = -(-kv_len // block_size)
        bucket = (width - 1).bit_length()
        rows_of.setdefault(bucket, []).append(row)
        widest[bucket] = max(widest.get(bucket, 0), width)
    buckets = []
    for key, row_ids in rows_of.items():
        width = widest[key]
        rows = torch.tensor(row_ids, dtype=torch.long)  # [n]
        lens = torch.tensor([kv_lens[r] for r in row_ids], device=device)  # [n]
        keys = torch.arange(width * block_size, device=device)  # [span]
        mask = keys < lens.unsqueeze(1)  # [n, span]
        if starts is not None:
            mask &= keys >= torch.tensor([starts[r] for r in row_ids], device=device).unsqueeze(1)
        buckets.append(
            DecodeBucket(
                token_rows=token_rows[rows.to(device)],
                flat_tables=tables.long()[rows.to(device), :width].reshape(-1),
                mask=mask[:, None, None, :],
                width=width,
            )
        )
    return buckets


def _decode_bucket(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    bucket: DecodeBucket,
    scale: float,
    out: torch.Tensor,
    softcap: float | None = None,
) -> None:
    """One masked SDPA over single-token rows: gather ``width`` blocks each, mask keys outside each row's."""
    n = bucket.token_rows.shape[0]
    heads, dim = k_cache.shape[2], k_cache.shape[3]
    span = bucket.width * k_cache.shape[1]
    # index_select is far cheaper than advanced indexing; [n, Hkv, span, D] strided views, no extra copy
    keys = k_cache.index_select(0, bucket.flat_tables).view(n, span, heads, dim).transpose(1, 2)
    values = v_cache.index_select(0, bucket.flat_tables).view(n, span, heads, dim).transpose(1, 2)
    q = query[bucket.token_rows].unsqueeze(2)  # [n, Hq, 1, D]
    attn = _attend(q, keys.to(q.dtype), values.to(q.dtype), bucket.mask, scale, softcap)  # [n, Hq, 1, D]
    out[bucket.token_rows] = attn.squeeze(2)


def _prefill_rows(
    inputs: StepInputs,
    host: _HostLengths,
    view: _KeyView,
    window: int | None,
    device: torch.device,
    verify: set[int],
) -> list[PrefillRow]:
    q_lens, cu, past = host.q_lens, host.cu, host.past
    if all(n == 1 or i in verify for i, n in enumerate(q_lens)):
        return []
    block_size = inputs.block_size
    tables = view.tables.long()  # [B, W]
    rows = []
    for i, q_len in enumerate(q_lens):
        if q_len == 1 or i in verify:
            continue
        first = view.first_pos[i]
        kv_len = past[i] + q_len - first  # keys gathered, from position ``first``
        mask = None
        if past[i] > 0 or window is not None:
            # Query j (absolute position past + j) sees keys past + j - window + 1 .. past + j.
            key_pos = torch.arange(first, first + kv_len, device=device)
            query_pos = torch.arange(past[i], past[i] + q_len, device=device)
            mask = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)  # [q_len, kv_len]
            if window is not None:
                mask &= key_pos.unsqueeze(0) > query_pos.unsqueeze(1) - window
        blocks = tables[i, : -(-kv_len // block_size)].to(device)
        rows.append(PrefillRow(start=cu[i], end=cu[i + 1], kv_len=kv_len, blocks=blocks, mask=mask))
    return rows


def _prefill_row(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    row: PrefillRow,
    scale: float,
    out: torch.Tensor,
    softcap: float | None = None,
) -> None:
    """One causal SDPA over a multi-token row's past + new keys (a loop over requests, not tokens).

    The tensors are 4-D ``[1, H, L, D]``: with 3-D inputs torch's CPU SDPA falls back to its unfused math
    path, 3-4x slower at 512 tokens (docs/performance.md).
    """
    heads, dim = k_cache.shape[2], k_cache.shape[3]
    keys = k_cache.index_select(0, row.blocks).view(-1, heads, dim)[: row.kv_len]  # [kv_len, Hkv, D]
    values = v_cache.index_select(0, row.blocks).view(-1, heads, dim)[: row.kv_len]  # [kv_len, Hkv, D]
    q = query[row.start : row.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
    keys = keys.transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, Hkv, kv_len, D]
    values = values.transpose(0, 1).unsqueeze(0).to(q.dtype)
    if softcap is None:
        attn = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=row.mask, is_causal=row.mask is None, scale=scale, enable_gqa=True
        )  # [1, Hq, q_len, D]
    else:
        mask = row.mask
        if mask is None:  # the row starts at position 0: plain causal, q_len == kv_len
            mask = torch.ones(row.kv_len, row.kv_len, dtype=torch.bool, device=q.device).tril()
        attn = _attend(q, keys, values, mask, scale, softcap)
    out[row.start : row.end] = attn[0].transpose(0, 1)


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """Masked GQA attention ``q [N, Hq, L, D]`` over ``keys/values [N, Hkv, S, D]`` (``mask`` broadcast to
    ``[N, Hq, L, S]``, True = attend); SDPA unless the scores are soft-capped.

    Why not SDPA with soft-capping: SDPA cannot squash the scores. The explicit form follows transformers'
    eager Gemma 2 attention step by step (scale, divide, tanh, multiply, mask, float32 softmax), so fp32
    results agree with it to rounding.
    """
    if softcap is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)  # [N, Hq, S, D]
    values = values.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [N, Hq, L, S]
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, values)


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
