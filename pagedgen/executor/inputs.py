"""Packing of variable-length step inputs: per-request chunks in, one padding-free :class:`StepInputs` out.

One engine step runs the model once over the concatenated unprocessed tokens of all scheduled requests, with
no padding. ``pack_step`` builds the packed tensors (docs/architecture.md, step 4) from a small per-request
description; the type itself lives in ``pagedgen.core.step_inputs`` so ops and models can name it without
importing the executor.

No host synchronisation: everything is computed on the host with numpy, written into one staging buffer
(pinned when the device is CUDA, so the copy is asynchronous) and copied to the device in one transfer
(:func:`_to_device`); every device tensor of the step is a view of that one copy. The host views stay
reachable as ``StepInputs.host`` for whoever plans on the host. Nothing here reads a device tensor back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedgen.core.step_inputs import HostStepInputs, StepInputs, WindowInputs


@dataclass(slots=True)
class SequenceChunk:
    """One scheduled request's share of a step.

    ``tokens`` are the request's unprocessed tokens sent this step, ``past_len`` the number of tokens already
    in its committed KV cache, ``block_table`` its physical blocks (committed + reserved), in logical order.
    ``all_logits`` asks for one logits row per token (draft verification) instead of only the last one; the
    row is then a verification row (``StepInputs.verify_rows``), whose tokens attend as decodes.
    ``window_ring`` is the request's ring of window blocks when its sliding-window layers keep one.
    ``samples=False`` (a partial prefill) asks for no logits row at all, so the step's logits rows are only
    those it samples, decided here on the host (no device indexing after the transfer).
    """

    tokens: Sequence[int]
    past_len: int
    block_table: Sequence[int]
    all_logits: bool = False
    window_ring: Sequence[int] = ()
    samples: bool = True


def pack_step(
    chunks: Sequence[SequenceChunk],
    block_size: int,
    device: torch.device | str = "cpu",
    window: int | None = None,
) -> StepInputs:
    """Pack per-request chunks into one flat, padding-free model input.

    Vectorised with numpy: the only Python loop is over requests (to concatenate their token lists),
    never over tokens; a step of plain decodes takes a shorter path of the same result
    (:func:`_pack_decodes`). With ``window`` (the sliding window of the layers that keep rings) every
    chunk must carry its ``window_ring`` and the step gets :class:`WindowInputs`. Raises ``ValueError``
    (building nothing) if there are no chunks, a chunk is empty, its past length is negative, its block
    table is too short or holds a negative block id, or a chunk would wrap its ring onto positions it still
    reads.
    """
    if not chunks:
        raise ValueError("pack_step needs at least one sequence chunk")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if window is None:
        decode = _pack_decodes(chunks, block_size, torch.device(device))
        if decode is not None:
            return decode
    return _pack_general(chunks, block_size, device, window)


def _pack_general(
    chunks: Sequence[SequenceChunk], block_size: int, device: torch.device | str, window: int | None
) -> StepInputs:
    """:func:`pack_step` for any step (prefills, drafts, rings), vectorised with numpy; it also validates."""
    q_lens = np.fromiter((len(c.tokens) for c in chunks), dtype=np.int64, count=len(chunks))
    if (q_lens <= 0).any():
        raise ValueError("every scheduled request must contribute at least one token")
    past = np.fromiter((c.past_len for c in chunks), dtype=np.int64, count=len(chunks))
    if (past < 0).any():
        bad = int(np.argmax(past < 0))
        raise ValueError(f"request row {bad} has a negative past_len {int(past[bad])}")
    widths = np.fromiter((len(c.block_table) for c in chunks), dtype=np.int64, count=len(chunks))
    kv_lens = past + q_lens
    need = (kv_lens + block_size - 1) // block_size
    if (widths < need).any():
        bad = int(np.argmax(widths < need))
        raise ValueError(
            f"request row {bad} holds {int(widths[bad])} blocks but needs {int(need[bad])} "
            f"for {int(kv_lens[bad])} tokens at block_size {block_size}"
        )
    cu = np.zeros(len(chunks) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    total = int(cu[-1])
    # One C-level copy per request (never a Python step per token, which long prefills would pay).
    input_ids = np.concatenate([np.asarray(c.tokens, dtype=np.int64) for c in chunks])
    # Position of each token: its request's past length plus its offset inside the request's chunk.
    row_of_token = np.repeat(np.arange(len(chunks)), q_lens)
    positions = past[row_of_token] + (np.arange(total) - cu[:-1][row_of_token])
    width = int(widths.max())
    tables = np.zeros((len(chunks), width), dtype=np.int64)
    for i, c in enumerate(chunks):
        tables[i, : len(c.block_table)] = c.block_table
    if (tables < 0).any():
        bad = int(np.argmax((tables < 0).any(axis=1)))
        raise ValueError(f"request row {bad} has a negative block id in {list(chunks[bad].block_table)}")
    blocks = tables[row_of_token, positions // block_size]
    slot_mapping = blocks * block_size + positions % block_size
    want_all = np.fromiter((c.all_logits for c in chunks), dtype=bool, count=len(chunks))
    samples = np.fromiter((c.samples for c in chunks), dtype=bool, count=len(chunks))
    if (want_all & ~samples).any():
        raise ValueError(
            f"request row {int(np.argmax(want_all & ~samples))} asks for all logits but samples none"
        )
    if want_all.any():
        logits_rows = np.concatenate(
            [np.zeros(0, dtype=np.int64)]
            + [
                np.arange(cu[i], cu[i + 1]) if want_all[i] else np.array([cu[i + 1] - 1])
                for i in range(len(chunks))
                if samples[i]
            ]
        )
    else:
        logits_rows = cu[1:] - 1 if samples.all() else (cu[1:] - 1)[samples]

    fields: dict[str, tuple[np.ndarray, torch.dtype]] = {
        "input_ids": (input_ids, torch.int64),
        "positions": (positions, torch.int64),
        "slot_mapping": (slot_mapping, torch.int64),
        "logits_rows": (logits_rows, torch.int64),
        "cu_seqlens": (cu, torch.int32),
        "past_lens": (past, torch.int32),
        "block_tables": (tables, torch.int32),
    }
    if window is not None:
        ring = _pack_window(chunks, window, block_size, past, kv_lens, row_of_token, positions)
        fields.update({f"window_{name}": value for name, value in ring.items()})
    host, dev = stage_arrays(fields, torch.device(device))
    window_inputs = None
    if window is not None:
        window_inputs = WindowInputs(
            size=window,
            block_tables=dev["window_block_tables"],
            first_pos=dev["window_first_pos"],
            slot_mapping=dev["window_slot_mapping"],
        )
    return _step_inputs(
        host,
        dev,
        max_query_len=int(q_lens.max()),
        max_kv_len=int(kv_lens.max()),
        min_kv_len=int(kv_lens.min()),
        block_size=block_size,
        window=window_inputs,
        verify_rows=tuple(int(i) for i in np.flatnonzero(want_all)),
    )


def _pack_decodes(
    chunks: Sequence[SequenceChunk], block_size: int, device: torch.device
) -> StepInputs | None:
    """:func:`pack_step` for a step of plain decodes (one token per chunk, one logits row each, no rings),
    or None when the step is anything else or a chunk is one that :func:`pack_step` refuses.

    Why: at batch 1 the vectorised packing's dozens of numpy calls on one-element arrays cost more than the
    step's whole bookkeeping; here each field is one short Python list, so the packing is a loop over the
    rows and one :func:`stage_arrays`. The tensors, dtypes and shapes are those of the general path (the
    unit tests compare the two); every refusal is left to the general path, so its errors stay the same.
    """
    ids, positions, slots, tables = [], [], [], []
    for c in chunks:
        tokens, past, table = c.tokens, c.past_len, c.block_table
        if len(tokens) != 1 or c.all_logits or not c.samples or past < 0 or len(table) <= past // block_size:
            return None
        if min(table) < 0:
            return None
        ids.append(tokens[0])
        positions.append(past)
        slots.append(table[past // block_size] * block_size + past % block_size)
        tables.append(table)
    rows = len(chunks)
    width = max(len(t) for t in tables)
    padded = [list(t) + [0] * (width - len(t)) if len(t) < width else t for t in tables]
    fields: dict[str, tuple[np.ndarray, torch.dtype]] = {
        "input_ids": (np.array(ids, dtype=np.int64), torch.int64),
        "positions": (np.array(positions, dtype=np.int64), torch.int64),
        "slot_mapping": (np.array(slots, dtype=np.int64), torch.int64),
        "logits_rows": (np.arange(rows, dtype=np.int64), torch.int64),
        "cu_seqlens": (np.arange(rows + 1, dtype=np.int64), torch.int32),
        "past_lens": (np.array(positions, dtype=np.int64), torch.int32),
        "block_tables": (np.array(padded, dtype=np.int64).reshape(rows, width), torch.int32),
    }
    host, dev = stage_arrays(fields, device)
    return _step_inputs(
        host,
        dev,
        max_query_len=1,
        max_kv_len=max(positions) + 1,
        min_kv_len=min(positions) + 1,
        block_size=block_size,
        window=None,
        verify_rows=(),
    )


def _step_inputs(
    host: dict[str, torch.Tensor],
    dev: dict[str, torch.Tensor],
    *,
    max_query_len: int,
    max_kv_len: int,
    min_kv_len: int,
    block_size: int,
    window: WindowInputs | None,
    verify_rows: tuple[int, ...],
) -> StepInputs:
    """The step from :func:`stage_arrays`'s host and device views (both packing paths end here)."""
    return StepInputs(
        input_ids=dev["input_ids"],
        positions=dev["positions"],
        cu_seqlens=dev["cu_seqlens"],
        past_lens=dev["past_lens"],
        block_tables=dev["block_tables"],
        slot_mapping=dev["slot_mapping"],
        logits_rows=dev["logits_rows"],
        max_query_len=max_query_len,
        max_kv_len=max_kv_len,
        min_kv_len=min_kv_len,
        block_size=block_size,
        window=window,
        verify_rows=verify_rows,
        host=HostStepInputs(
            **{name: host[name] for name in HOST_FIELDS},
            window_first_pos=host.get("window_first_pos"),
            window_slot_mapping=host.get("window_slot_mapping"),
        ),
    )


HOST_FIELDS = (
    "input_ids",
    "positions",
    "cu_seqlens",
    "past_lens",
    "block_tables",
    "slot_mapping",
    "logits_rows",
)
_NUMPY_DTYPE = {torch.int64: np.int64, torch.int32: np.int32}
_ALIGN = 8  # every field starts on an 8-byte boundary, so each byte range can be viewed as its dtype


def _to_device(staging: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The step's one host-to-device transfer (a module function, so tests can count the calls).

    Asynchronous from pinned memory: the caching host allocator keeps the staging block alive until the copy
    has run, so the next step may allocate a new one while this one is in flight.
    """
    return staging.to(device, non_blocking=True)


def stage_arrays(
    fields: dict[str, tuple[np.ndarray, torch.dtype]], device: torch.device
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Write ``fields`` (name -> host array, dtype) into one staging buffer and copy it to ``device`` once.

    Returns (host views, device views), each shaped like its array. On the CPU the device views are the host
    views (no copy at all). The staging buffer is pinned when ``device`` is CUDA.
    """
    offsets: dict[str, int] = {}
    total = 0
    for name, (array, dtype) in fields.items():
        offsets[name] = total
        nbytes = array.size * dtype.itemsize
        total += -(-nbytes // _ALIGN) * _ALIGN
    staging = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=device.type == "cuda")  # [bytes]
    flat = staging.numpy()
    host: dict[str, torch.Tensor] = {}
    for name, (array, dtype) in fields.items():
        np_dtype = _NUMPY_DTYPE[dtype]
        start = offsets[name]
        view = flat[start : start + array.size * dtype.itemsize].view(np_dtype)
        view[:] = array.ravel()
        host[name] = torch.from_numpy(view.reshape(array.shape))  # shares the staging buffer's memory
    if device.type == "cpu":
        return host, host
    moved = _to_device(staging, device)
    dev = {}
    for name, (array, dtype) in fields.items():
        start = offsets[name]
        dev[name] = moved[start : start + array.size * dtype.itemsize].view(dtype).view(array.shape)
    return host, dev


def _pack_window(
    chunks: Sequence[SequenceChunk],
    window: int,
    block_size: int,
    past: np.ndarray,
    kv_lens: np.ndarray,
    row_of_token: np.ndarray,
    positions: np.ndarray,
) -> dict[str, tuple[np.ndarray, torch.dtype]]:
    """Ring tables and slots of the windowed layers (arithmetic of :mod:`pagedgen.core.window_geometry`),
    as host arrays for :func:`stage_arrays` (name -> array, dtype).

    Row ``i`` reads from position ``first_pos = (lo // B) * B``, ``lo = max(0, past - W + 1)`` being the
    first key its earliest query sees; column ``k`` is ring block ``(first_pos // B + k) mod R``.
    """
    if window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    ring_lens = np.fromiter((len(c.window_ring) for c in chunks), dtype=np.int64, count=len(chunks))
    if (ring_lens <= 0).any():
        raise ValueError(f"request row {int(np.argmax(ring_lens <= 0))} has no window ring")
    live = kv_lens - past + window - 1  # positions the step writes plus those its first query still reads
    if (live > ring_lens * block_size).any():
        bad = int(np.argmax(live > ring_lens * block_size))
        raise ValueError(
            f"request row {bad}: {int(kv_lens[bad] - past[bad])} tokens with window {window} need "
            f"{int(live[bad])} live slots but its ring holds {int(ring_lens[bad] * block_size)}"
        )
    rings = np.zeros((len(chunks), int(ring_lens.max())), dtype=np.int64)
    for i, c in enumerate(chunks):
        rings[i, : len(c.window_ring)] = c.window_ring
    if (rings < 0).any():
        raise ValueError("a window ring holds a negative block id")
    first_block = np.maximum(past - window + 1, 0) // block_size  # [B]
    first_pos = first_block * block_size
    width = int(((kv_lens - first_pos + block_size - 1) // block_size).max())
    rows = np.arange(len(chunks))[:, None]
    columns = (first_block[:, None] + np.arange(width)[None, :]) % ring_lens[:, None]  # [B, width]
    tables = rings[rows, columns]
    token_blocks = rings[row_of_token, (positions // block_size) % ring_lens[row_of_token]]
    return {
        "block_tables": (tables, torch.int32),
        "first_pos": (first_pos, torch.int32),
        "slot_mapping": (token_blocks * block_size + positions % block_size, torch.int64),
    }
