"""What the engine-level family tests against transformers share (tests/model/test_model_*.py).

Prompt ids, the small engine every case runs on, the whole-sequence greedy oracle and the recoverable faults
injected at every phase.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

import pagedgen as pg
from pagedgen.engine.faults import InjectedFault
from pagedgen.executor.runner import ExecutionCapacityError, RetryableExecutionError
from tests.helpers import make_engine

RECOVERABLE = [
    ("checkpoint", InjectedFault("x")),
    ("pack", InjectedFault("x")),
    ("execute", RetryableExecutionError("transient")),
    ("execute", ExecutionCapacityError("oom")),
    ("sample", InjectedFault("x")),
    ("stage", InjectedFault("x")),
    ("validate", InjectedFault("x")),
]
RECOVERABLE_IDS = [f"{p}-{type(e).__name__}" for p, e in RECOVERABLE]


def ids_of(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 260, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def small_engine(model: Any, **config: Any) -> pg.Engine:
    """Small blocks and chunks, so a few dozen tokens cross many blocks, chunks and ring turns."""
    config = {"block_size": 4, "num_blocks": 96, "chunk_size": 5, "max_batch_size": 4, **config}
    return make_engine(model, **config)


def greedy_by_forwards(hf: Any, ids: Sequence[int], n: int) -> list[int]:
    """Greedy continuation by whole-sequence forwards (no cache: the oracle of every step)."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids) :]
