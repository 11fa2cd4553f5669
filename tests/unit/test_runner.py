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


class ThreadsModel(SyntheticModel):
    """Records torch's thread count as each forward begins."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.threads: list[int] = []

    def forward(self, inputs, kv_cache):
        self.threads.append(torch.get_num_threads())
        return super().forward(inputs, kv_cache)


@pytest.mark.cpu
def test_a_one_row_step_leaves_torch_on_one_thread_for_its_sampler_and_the_next_step_gets_them_back():
    from pagedgen.ops.matmul.gemm_threads import torch_pool

    before = torch.get_num_threads()
    torch_pool.restore()
    torch_pool.set_full(2)
    try:
        model = ThreadsModel()
        runner = ModelRunner(model, num_blocks=8, block_size=16)
        two_rows = pack_step([SequenceChunk([1], 0, [0]), SequenceChunk([2], 0, [1])], block_size=16)
        runner.execute(two_rows)
        assert torch.get_num_threads() == 2 and not torch_pool.parked  # two rows: nothing changes
        runner.execute(_step(3))  # one logits row
        assert torch.get_num_threads() == 1 and torch_pool.parked
        runner.execute(two_rows)  # the forward begins as the last forward left the pool
        assert model.threads == [2, 2, 2] and torch.get_num_threads() == 2
        runner.execute(_step(3))
        runner.release()  # the engine's teardown gives the threads back too
        assert torch.get_num_threads() == 2 and not torch_pool.parked
    finally:
        torch_pool.restore()
        torch_pool.set_full(before)
