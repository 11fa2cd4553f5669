"""The packed inputs of one model call: the contract between the engine, the executor, ops and every model.

One engine step runs the model once over the concatenated unprocessed tokens of all scheduled requests,
with no padding. ``pagedgen.executor.inputs.pack_step`` builds a :class:`StepInputs`; the model writes new
K/V through ``slot_mapping`` and reads history through ``block_tables``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class WindowInputs:
    """How the step's sliding-window layers reach their ring of blocks (:mod:`pagedgen.core.window_geometry`).

    Each row's keys are read from logical block ``first_pos[i] // block_size`` on: column ``k`` of
    ``block_tables`` holds logical block ``first_pos[i] // block_size + k`` (its ring block), so the table is
    as wide as the live window plus one step, never as the sequence.
    """

    size: int  # W: a query at p sees keys p - W + 1 .. p
    block_tables: torch.Tensor  # [B, Wr] int32, ring blocks rotated to start at each row's first_pos
    first_pos: torch.Tensor  # [B] int32, logical position of column 0 (a multiple of block_size)
    slot_mapping: torch.Tensor  # [T] int64, ring slot of each new token (p mod (R * block_size) in its ring)


@dataclass(slots=True)
class FixedStateInputs:
    """The step's fixed (request-indexed) state, one row per scheduled request in step order.

    ``inputs[name]`` holds each row's committed state (read only: it may be the pool's visible bank);
    the model writes each row's state after its last token of the step into ``outputs[name]``, which is
    never visible committed state (an inactive bank or staging), so a rolled-back step changes nothing.
    """

    inputs: dict[str, torch.Tensor]  # name -> [B, *row]
    outputs: dict[str, torch.Tensor]  # name -> [B, *row]


@dataclass(slots=True)
class HostStepInputs:
    """The CPU copies a step's device tensors were transferred from (views of its staging buffer).

    Why: anything that plans on the host (attention metadata, CUDA-graph padding) reads these instead of
    the device tensors, so planning never waits for the device (no ``.item()`` / ``.tolist()`` on a device
    tensor inside a step). On a CPU step they are the very tensors of :class:`StepInputs`. Read only.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    cu_seqlens: torch.Tensor  # [B+1] int32
    past_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, W] int32
    slot_mapping: torch.Tensor  # [T] int64
    logits_rows: torch.Tensor  # [R] int64, the rows whose logits the step returns
    window_first_pos: torch.Tensor | None = None  # [B] int32, WindowInputs.first_pos's copy (rings only)
    window_slot_mapping: torch.Tensor | None = (
        None  # [T] int64, WindowInputs.slot_mapping's copy (rings only)
    )

    @property
    def query_lens(self) -> torch.Tensor:  # [B] int32
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    @property
    def kv_lens(self) -> torch.Tensor:  # [B] int32
        return self.past_lens + self.query_lens


@dataclass(slots=True)
class StepInputs:
    """The packed inputs of one model call (B requests, T tokens)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each token
    cu_seqlens: torch.Tensor  # [B+1] int32, request boundaries in the flat token array
    past_lens: torch.Tensor  # [B] int32, committed KV length of each request
    block_tables: torch.Tensor  # [B, W] int32, physical block ids, padded with 0 past each table's end
    slot_mapping: torch.Tensor  # [T] int64, flat cache slot (block * block_size + offset) of each new token
    logits_rows: torch.Tensor  # [R] int64, rows of the flat token array whose logits are returned
    max_query_len: int  # attention metadata: longest query of the step
    max_kv_len: int  # attention metadata: longest past + query of the step
    min_kv_len: int  # attention metadata: shortest past + query of the step
    block_size: int
    window: WindowInputs | None = None  # set when windowed layers keep rings (else they read block_tables)
    fixed: FixedStateInputs | None = None  # set for models with fixed conv / recurrent state
    # Rows that verify drafts: each of their tokens attends like a decode of its own (the keys through its
    # position), so attention plans them as single-token decode rows and a step of decodes and draft rows
    # stays a pure decode step for the kernels (pagedgen.ops.mixers.attention.plan_attention).
    verify_rows: tuple[int, ...] = ()
    # The host copies the tensors above were transferred from (pagedgen.executor.inputs.pack_step sets them).
    # None for inputs built elsewhere and for a captured CUDA graph's static inputs, whose per-step lengths
    # exist only on the device: a captured step's kernels read lengths from the device tensors and size their
    # work from max_query_len / max_kv_len, which are bounds valid for every replay of the graph.
    host: HostStepInputs | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.past_lens.shape[0])

    @property
    def query_lens(self) -> torch.Tensor:  # [B] int32
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    @property
    def kv_lens(self) -> torch.Tensor:  # [B] int32, past + query per request
        return self.past_lens + self.query_lens
