"""What rank 0 sends the other ranks: a step's packed inputs (host copies) and the few control commands.

Why host arrays: every rank rebuilds the same :class:`StepInputs` on its own device with the packer's own
staging (:func:`pagedgen.executor.inputs.stage_arrays`), so the model sees exactly what rank 0's sees; numpy
arrays pickle by value (torch tensors sent through a multiprocessing pipe would go through shared memory).
A worker's copy asks for no logits rows: only rank 0 samples, so only rank 0 runs the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagedgen.core.step_inputs import HostStepInputs, StepInputs, WindowInputs
from pagedgen.executor.inputs import stage_arrays

_INT32 = frozenset({"cu_seqlens", "past_lens", "block_tables", "window_block_tables", "window_first_pos"})


def _host(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().cpu().numpy().copy()


@dataclass(frozen=True, slots=True)
class StepMessage:
    """One step's inputs as host arrays (``arrays``: field name -> array) and its scalar metadata."""

    arrays: dict[str, np.ndarray]
    max_query_len: int
    max_kv_len: int
    min_kv_len: int
    block_size: int
    window_size: int | None
    verify_rows: tuple[int, ...]

    @classmethod
    def from_inputs(cls, inputs: StepInputs) -> StepMessage:
        """The message of rank 0's step (its host copies where the packer kept them)."""
        src = inputs if inputs.host is None else inputs.host
        arrays = {
            name: _host(getattr(src, name))
            for name in ("input_ids", "positions", "cu_seqlens", "past_lens", "block_tables", "slot_mapping")
        }
        window = inputs.window
        if window is not None:
            arrays["window_block_tables"] = _host(window.block_tables)
            arrays["window_first_pos"] = _host(window.first_pos)
            arrays["window_slot_mapping"] = _host(window.slot_mapping)
        if inputs.fixed is not None:
            raise ValueError("tensor-parallel steps carry no fixed conv / recurrent state")
        return cls(
            arrays,
            inputs.max_query_len,
            inputs.max_kv_len,
            inputs.min_kv_len,
            inputs.block_size,
            None if window is None else window.size,
            inputs.verify_rows,
        )

    def to_inputs(self, device: torch.device) -> StepInputs:
        """The same step on ``device``, with no logits rows (a worker rank does not sample)."""
        arrays = {**self.arrays, "logits_rows": np.zeros(0, dtype=np.int64)}
        fields = {name: (a, torch.int32 if name in _INT32 else torch.int64) for name, a in arrays.items()}
        host, dev = stage_arrays(fields, device)
        window = None
        if self.window_size is not None:
            window = WindowInputs(
                self.window_size,
                dev["window_block_tables"],
                dev["window_first_pos"],
                dev["window_slot_mapping"],
            )
        names = ("input_ids", "positions", "cu_seqlens", "past_lens", "block_tables", "slot_mapping")
        return StepInputs(
            **{name: dev[name] for name in names},
            logits_rows=dev["logits_rows"],
            max_query_len=self.max_query_len,
            max_kv_len=self.max_kv_len,
            min_kv_len=self.min_kv_len,
            block_size=self.block_size,
            window=window,
            verify_rows=self.verify_rows,
            host=HostStepInputs(
                **{name: host[name] for name in (*names, "logits_rows")},
                window_first_pos=host.get("window_first_pos"),
                window_slot_mapping=host.get("window_slot_mapping"),
            ),
        )


@dataclass(frozen=True, slots=True)
class AdaptGemm:
    """Measure (or read) the GEMM tables for this rank's shapes, as ``ModelRunner.adapt_gemm``."""

    max_batch_size: int
    max_scheduled_tokens: int
    chunk_size: int | None


@dataclass(frozen=True, slots=True)
class Stop:
    """End the worker loop (the engine closes)."""


@dataclass(frozen=True, slots=True)
class Ready:
    """A worker's reply once it has joined the group and holds its shard."""

    rank: int
    weight_bytes: int
    dequantized_slices: int = 0


@dataclass(frozen=True, slots=True)
class Done:
    """A worker's reply to a command that rank 0 waits for (``AdaptGemm``)."""


@dataclass(frozen=True, slots=True)
class Failed:
    """A worker's last word before it exits: what went wrong, as text."""

    rank: int
    error: str
    details: list[str] = field(default_factory=list)
