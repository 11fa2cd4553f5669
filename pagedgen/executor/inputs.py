"""Packing of variable-length step inputs: per-request chunks in, one padding-free :class:`StepInputs` out.

One engine step runs the model once over the concatenated unprocessed tokens of all scheduled requests,
with no padding. ``pack_step`` builds the tensors of DESIGN.md from a small per-request description; the
type itself lives in ``pagedgen.core.step_inputs`` so ops and models can name it without importing the
executor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedgen.core.step_inputs import StepInputs


@dataclass(slots=True)
class SequenceChunk:
    """One scheduled request's share of a step.

    ``tokens`` are the request's unprocessed tokens sent this step, ``past_len`` the number of tokens already
    in its committed KV cache, ``block_table`` its physical blocks (committed + reserved), in logical order.
    ``all_logits`` asks for one logits row per token (draft verification) instead of only the last one.
    """

    tokens: Sequence[int]
    past_len: int
    block_table: Sequence[int]
    all_logits: bool = False


def pack_step(
    chunks: Sequence[SequenceChunk], block_size: int, device: torch.device | str = "cpu"
) -> StepInputs:
    """Pack per-request chunks into one flat, padding-free model input.

    Vectorised with numpy: the only Python loop is over requests (to concatenate their token lists),
    never over tokens. Raises ``ValueError`` (building nothing) if there are no chunks, a chunk is empty,
    its past length is negative, its block table is too short or holds a negative block id.
    """
    if not chunks:
        raise ValueError("pack_step needs at least one sequence chunk")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
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
    if want_all.any():
        logits_rows = np.concatenate(
            [
                np.arange(cu[i], cu[i + 1]) if want_all[i] else np.array([cu[i + 1] - 1])
                for i in range(len(chunks))
            ]
        )
    else:
        logits_rows = cu[1:] - 1

    def to(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(a).to(device=device, dtype=dtype)

    return StepInputs(
        input_ids=to(input_ids, torch.int64),
        positions=to(positions, torch.int64),
        cu_seqlens=to(cu, torch.int32),
        past_lens=to(past, torch.int32),
        block_tables=to(tables, torch.int32),
        slot_mapping=to(slot_mapping, torch.int64),
        logits_rows=to(logits_rows.astype(np.int64), torch.int64),
        max_query_len=int(q_lens.max()),
        max_kv_len=int(kv_lens.max()),
        min_kv_len=int(kv_lens.min()),
        block_size=block_size,
    )
