"""The model-execution boundary: owns the physical KV cache and runs the model once per engine step.

The runner is where the reference's ONNX decoder session sits. It classifies execution failures into the
two types the engine can recover from, and lets everything else through as an unknown (fatal) failure.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedgen.core.kv import PagedKVCache
from pagedgen.core.step_inputs import StepInputs
from pagedgen.errors import PagedGenError
from pagedgen.models.llama import Linear
from pagedgen.ops.cpu_memory import retain_freed_cpu_memory
from pagedgen.ops.gemm import gemm_step
from pagedgen.ops.gemm_tune import adapt_to_model


class RetryableExecutionError(PagedGenError, RuntimeError):
    """The executor reports a transient failure: the step is rolled back and may be retried unchanged."""


class ExecutionCapacityError(PagedGenError, RuntimeError):
    """The model run exceeded available memory: the step is rolled back; the engine stays healthy."""


class ModelRunner:
    """Runs ``model.runtime.forward`` over packed step inputs against one long-lived :class:`PagedKVCache`.

    ``num_blocks``/``block_size`` must match the cache manager's pool (``window_blocks`` its window-ring pool,
    when sliding-window layers keep rings): the manager decides block ownership, this object only holds the
    storage the block ids point into.
    """

    def __init__(self, model: Any, num_blocks: int, block_size: int, window_blocks: int | None = None):
        self.model = model
        self.runtime = model.runtime
        self.device = torch.device(model.device)
        self.vocab_size = int(model.vocab_size)
        if self.device.type == "cpu":
            # Step temporaries (gathered K/V, activations) are reused instead of re-faulted every step.
            retain_freed_cpu_memory()
        self.kv_cache: PagedKVCache | None = PagedKVCache(
            model.kv_spec, num_blocks, block_size, device=self.device, window_blocks=window_blocks
        )

    def adapt_gemm(self, max_batch_size: int, max_scheduled_tokens: int, chunk_size: int | None) -> None:
        """Pick the GEMM backend per step size, and for weights kept in their stored format the quantized
        path per kind and row count, for this machine and model (measured once per machine, then read from
        the cache; :mod:`pagedgen.ops.gemm_tune`). A no-op for models with neither CPU fp32 nor quantized
        linear layers and for tables that were pinned."""
        adapt_to_model(self.runtime, (Linear,), max_batch_size, max_scheduled_tokens, chunk_size)

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Run the model once; returns float logits ``[len(inputs.logits_rows), vocab]``.

        Raises ``ExecutionCapacityError`` when the run exhausts device or host memory, a ``RuntimeError``
        when the model returns logits of the wrong shape; other model errors propagate unchanged.
        """
        try:
            # The step's token count steers every linear call: no thread-pool hand-over mid-step, e.g.
            # between a prefill's layers and its few-row LM head (pagedgen.ops.gemm.gemm_step).
            with torch.inference_mode(), gemm_step(inputs.num_tokens):
                logits = self.runtime.forward(inputs, self.kv_cache)  # [R, vocab]
        except (torch.OutOfMemoryError, MemoryError) as exc:
            raise ExecutionCapacityError(f"model execution ran out of memory: {exc}") from exc
        expected = (int(inputs.logits_rows.shape[0]), self.vocab_size)
        if tuple(logits.shape) != expected:
            raise RuntimeError(f"model returned logits of shape {tuple(logits.shape)}, expected {expected}")
        return logits

    def release(self) -> None:
        """Drop the KV storage (engine teardown); ``execute`` must not be called afterwards."""
        self.kv_cache = None
