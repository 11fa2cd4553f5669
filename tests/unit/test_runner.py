"""The model runner: one GEMM backend per step, logits shape checks, failure classification."""

from __future__ import annotations

import pytest
import torch

from pagedgen.errors import ExecutionCapacityError
from pagedgen.executor.inputs import SequenceChunk, pack_step
from pagedgen.executor.runner import ModelRunner
from pagedgen.models.synthetic import SyntheticModel
from pagedgen.ops.matmul.gemm import GemmBackend, GemmTable, RowBucket, choose_backend, use_gemm_table

# Backends on different thread pools: OpenBLAS up to 16 rows, torch above.
OPENBLAS_SMALL = GemmTable(buckets=(RowBucket(16, GemmBackend.OPENBLAS),), default=GemmBackend.TORCH)


class RecordingModel(SyntheticModel):
    """Synthetic model that records which GEMM backend a 1-row linear call would take inside its forward."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.seen: list[GemmBackend] = []

    def forward(self, inputs, kv_cache):
        self.seen.append(choose_backend(1, 576, 49152))  # an LM-head-shaped call over one sampled row
        return super().forward(inputs, kv_cache)


def _step(num_tokens: int):
    return pack_step([SequenceChunk(list(range(1, num_tokens + 1)), 0, list(range(8)))], block_size=16)


@pytest.mark.cpu
def test_every_linear_call_of_a_step_uses_the_steps_backend():
    model = RecordingModel()
    runner = ModelRunner(model, num_blocks=8, block_size=16)
    with use_gemm_table(OPENBLAS_SMALL):  # the table whose backends own different thread pools
        runner.execute(_step(3))  # a decode-sized step: OpenBLAS, the 1-row head included
        runner.execute(_step(100))  # a prefill: its 1-row head stays on torch with the rest of the step
        assert choose_backend(1, 576, 49152) is GemmBackend.OPENBLAS  # the scope ended with the step
    assert model.seen == [GemmBackend.OPENBLAS, GemmBackend.TORCH]


class OutOfMemoryModel(SyntheticModel):
    def forward(self, inputs, kv_cache):
        raise torch.OutOfMemoryError("no room")


def test_out_of_memory_is_a_capacity_error():
    runner = ModelRunner(OutOfMemoryModel(), num_blocks=8, block_size=16)
    with pytest.raises(ExecutionCapacityError, match="ran out of memory"):
        runner.execute(_step(2))


class WrongShapeModel(SyntheticModel):
    def forward(self, inputs, kv_cache):
        return torch.zeros(5, self.vocab_size)


def test_wrong_logits_shape_is_refused():
    runner = ModelRunner(WrongShapeModel(), num_blocks=8, block_size=16)
    with pytest.raises(RuntimeError, match=r"logits of shape \(5, 257\), expected \(1, 257\)"):
        runner.execute(_step(2))
