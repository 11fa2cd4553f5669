"""The model-execution boundary: owns the physical KV cache and runs the model once per engine step.

The runner is the step's execute phase (docs/architecture.md, "The engine step"). It classifies execution
failures into the two types the engine can recover from, and lets everything else through as an unknown
(fatal) failure.

On CUDA with ``cuda_graphs`` (EngineConfig), eligible pure decode steps replay captured graphs
(:mod:`pagedgen.executor.cuda_graphs`) and every other step runs eagerly; on the CPU graphs are ignored.
The graph path is UNVERIFIED ON HARDWARE until a GPU session runs ``scripts/gpu_check.py``.
"""

from __future__ import annotations

from typing import Protocol

import torch

from pagedgen.core.decoder import DecoderModel
from pagedgen.core.kv import PagedKVCache
from pagedgen.core.step_inputs import StepInputs
from pagedgen.errors import ExecutionCapacityError
from pagedgen.executor.cuda_graphs import (
    CudaGraphCapture,
    DecodeGraphs,
    GraphCapture,
    GraphGeometry,
    StaticDecodeBuffers,
)
from pagedgen.models.llama import Linear
from pagedgen.ops.kernels.cpu_memory import release_freed_cpu_memory, retain_freed_cpu_memory
from pagedgen.ops.matmul.gemm import gemm_step
from pagedgen.ops.matmul.gemm_threads import torch_pool
from pagedgen.ops.matmul.gemm_tune import adapt_to_model
from pagedgen.ops.mixers.attention import check_step_slots


class StepRunner(Protocol):
    """The execute phase's collaborator: :class:`ModelRunner` here, ``TensorParallelRunner`` across ranks."""

    def adapt_gemm(self, max_batch_size: int, max_scheduled_tokens: int, chunk_size: int | None) -> None: ...

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Float logits ``[len(inputs.logits_rows), vocab]``; raises the executor's classified errors."""
        ...

    def release(self) -> None: ...


class ModelRunner:
    """Runs ``model.runtime.forward`` over packed step inputs against one long-lived :class:`PagedKVCache`.

    ``num_blocks``/``block_size`` must match the cache manager's pool (``window_blocks`` its window-ring pool,
    when sliding-window layers keep rings): the manager decides block ownership, this object only holds the
    storage the block ids point into.
    """

    def __init__(
        self,
        model: DecoderModel,
        num_blocks: int,
        block_size: int,
        window_blocks: int | None = None,
        *,
        cuda_graphs: bool = False,
        max_batch_size: int | None = None,
        graph_capture: GraphCapture | None = None,
    ):
        self.model = model
        self.runtime = model.runtime
        self.device = torch.device(model.device)
        self.vocab_size = int(model.vocab_size)
        self._parked_for_sampling = False  # execute parked torch's pool for a one-row step's sampler
        if self.device.type == "cpu":
            # Step temporaries (gathered K/V, activations) are reused instead of re-faulted every step.
            retain_freed_cpu_memory()
        capture = graph_capture  # tests inject a stand-in to drive the bookkeeping on the CPU
        if capture is None and cuda_graphs and self.device.type == "cuda":
            capture = CudaGraphCapture(self.device)
        if capture is not None and not _graph_capable(model):
            capture = None
        if capture is not None and max_batch_size is None:
            raise ValueError("CUDA graphs need max_batch_size (the largest batch bucket)")
        # With graphs, one block past the manager's pool is the padding rows' scratch block.
        storage_blocks = num_blocks + (1 if capture is not None else 0)
        self.kv_cache: PagedKVCache | None = PagedKVCache(
            model.kv_spec, storage_blocks, block_size, device=self.device, window_blocks=window_blocks
        )
        self.graphs: DecodeGraphs | None = None
        if capture is not None and max_batch_size is not None:
            geometry = GraphGeometry(max_batch_size, -(-int(model.max_context) // block_size), block_size)
            buffers = StaticDecodeBuffers(geometry, self.device, scratch_block=num_blocks)
            self.graphs = DecodeGraphs(geometry, buffers, capture, self._forward)

    def adapt_gemm(self, max_batch_size: int, max_scheduled_tokens: int, chunk_size: int | None) -> None:
        """Pick the GEMM backend per step size, and for weights kept in their stored format the quantized
        path per kind and row count, for this machine and model (measured once per machine, then read from
        the cache; :mod:`pagedgen.ops.matmul.gemm_tune`). A no-op for models with neither CPU fp32 nor
        quantized linear layers and for tables that were pinned."""
        adapt_to_model(self.runtime, (Linear,), max_batch_size, max_scheduled_tokens, chunk_size)
        if self.device.type == "cpu":
            release_freed_cpu_memory()  # a measurement's prefill-sized temporaries, not needed again

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Run the model once; returns float logits ``[len(inputs.logits_rows), vocab]``.

        Raises ``IndexError`` (before the model runs) when a slot of the step's host copies lies outside the
        cache, ``ExecutionCapacityError`` when the run exhausts device or host memory, a ``RuntimeError``
        when the model returns logits of the wrong shape; other model errors propagate unchanged.
        """
        self.check_slots(inputs)
        self._unpark()
        try:
            logits = None if self.graphs is None else self.graphs.run(inputs)
            if logits is None:
                logits = self._forward(inputs)  # [R, vocab]
        except (torch.OutOfMemoryError, MemoryError) as exc:
            raise ExecutionCapacityError(f"model execution ran out of memory: {exc}") from exc
        expected = (int(inputs.logits_rows.shape[0]), self.vocab_size)
        if tuple(logits.shape) != expected:
            raise RuntimeError(f"model returned logits of shape {tuple(logits.shape)}, expected {expected}")
        if self.device.type == "cpu" and expected[0] == 1 and not torch_pool.parked:
            # One logits row: the sampler's vocabulary-wide ops gain nothing from torch's second thread but
            # its wake-up (milliseconds on a busy machine). The next execute (or release) restores the pool,
            # so every forward starts with the pool as the previous forward left it.
            torch_pool.park()
            self._parked_for_sampling = True
        return logits

    def _unpark(self) -> None:
        """Undo the park of a one-row step (:meth:`execute`); a no-op otherwise."""
        if self._parked_for_sampling:
            torch_pool.restore()
            self._parked_for_sampling = False

    def check_slots(self, inputs: StepInputs) -> None:
        """Refuse a step that would write outside the cache, from its host copies (IndexError, nothing
        written): ``write_kv`` reads no device slot back, so on a device this is the only check."""
        cache = self.kv_cache
        if cache is None:
            return
        window = cache.window_blocks * cache.block_size if cache.window_ring else None
        check_step_slots(inputs, cache.num_blocks * cache.block_size, window)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """One eager model call (also what a graph captures)."""
        # The step's token count steers every linear call: no thread-pool hand-over mid-step, e.g.
        # between a prefill's layers and its few-row LM head (pagedgen.ops.matmul.gemm.gemm_step).
        with torch.inference_mode(), gemm_step(inputs.num_tokens):
            return self.runtime.forward(inputs, self.kv_cache)  # [R, vocab]

    def release(self) -> None:
        """Drop the KV storage and the graphs (engine teardown); ``execute`` must not be called afterwards."""
        self.kv_cache = None
        self.graphs = None
        self._unpark()


def _graph_capable(model: DecoderModel) -> bool:
    """Whether the model's state fits the static decode buffers: no sliding-window layers (their rings
    and masks are not in the buffers) and no fixed conv / recurrent state (not in the capture
    contract)."""
    return not model.kv_spec.window_layers and not model.fixed_state_specs
