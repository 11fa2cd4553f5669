"""A tensor-parallel rank other than 0: its own process, its own shard and KV cache, the same forward.

One loop for both launchers (:mod:`pagedgen.parallel.launch`): a local subprocess runs it on an inherited
pipe, a Ray actor on the socket rank 0 connected to; both are a :class:`Connection` carrying the same
messages.

The worker joins the group, loads the checkpoint the engine's model came from, keeps its shard (the full
weights are freed), builds a :class:`ModelRunner` over a KV cache of only its KV heads with the engine's
block count, and then runs every step rank 0 sends, in order. It never plans, samples or commits: rank 0's
transaction decides what runs, so a rolled-back step needs nothing here (its K/V writes went to slots that
rank 0's cache manager discards, exactly as on rank 0).

A failure here is reported to rank 0 as :class:`Failed` and ends the process; rank 0 then finds the group
broken (its next collective fails) and the engine becomes unhealthy. The connection's end (rank 0 gone)
ends the worker too, so no rank outlives its engine.
"""

from __future__ import annotations

import contextlib
import gc
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from pagedgen.core.kv import KVSpec
from pagedgen.parallel.comm import GroupAddress, join_group
from pagedgen.parallel.messages import AdaptGemm, Done, Failed, Ready, StepMessage, Stop
from pagedgen.parallel.shard import plan_for, shard_llama, weight_bytes


@dataclass(frozen=True, slots=True)
class ModelSource:
    """How a worker loads the engine's model again: ``pg.Model(source, dtype, device, weights, ...)``."""

    source: str
    dtype: torch.dtype
    weights: str
    activations: str


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Everything a worker needs, picklable: its rank, the group, the model and rank 0's cache geometry."""

    rank: int
    address: GroupAddress
    model: ModelSource
    device: str
    num_blocks: int
    block_size: int
    window_blocks: int | None
    threads: int | None  # CPU threads of this rank (None: leave the defaults)


@dataclass(frozen=True, slots=True)
class ShardedModel:
    """What :class:`pagedgen.executor.runner.ModelRunner` reads of a model, for one rank's shard."""

    runtime: torch.nn.Module
    device: torch.device
    vocab_size: int
    max_context: int

    @property
    def kv_spec(self) -> KVSpec:
        return self.runtime.kv_spec

    @property
    def fixed_state_specs(self) -> tuple:
        return ()


def _load_shard(spec: WorkerSpec):
    """This rank's group, runner and shard report (the full checkpoint is loaded, cut, then freed)."""
    from pagedgen.executor.runner import ModelRunner
    from pagedgen.models.model import Model
    from pagedgen.ops.matmul.gemm_threads import configure_cpu_threads

    device = torch.device(spec.device)
    if spec.threads is not None:
        configure_cpu_threads(spec.threads)
    reduce = join_group(spec.address, spec.rank, device)
    src = spec.model
    model = Model(
        src.source, dtype=src.dtype, device=device, weights=src.weights, activations=src.activations
    )
    shard = plan_for(model.runtime, spec.address.world_size)[spec.rank]
    runtime, report = shard_llama(model.runtime, shard, reduce)
    view = ShardedModel(runtime, device, model.vocab_size, model.max_context)
    del model
    gc.collect()
    runner = ModelRunner(view, spec.num_blocks, spec.block_size, spec.window_blocks, cuda_graphs=False)
    return reduce, runner, report


def _serve(conn: Connection, runner, device: torch.device) -> None:
    """Run commands until :class:`Stop` or the pipe's end."""
    while True:
        try:
            command = conn.recv()
        except EOFError:
            return
        if isinstance(command, Stop):
            return
        if isinstance(command, StepMessage):
            runner.execute(command.to_inputs(device))
        elif isinstance(command, AdaptGemm):
            runner.adapt_gemm(command.max_batch_size, command.max_scheduled_tokens, command.chunk_size)
            conn.send(Done())
        else:
            raise TypeError(f"tensor-parallel worker got an unknown command {type(command).__name__}")


def worker_main(conn: Connection) -> None:
    """The worker process's body: the first message is its :class:`WorkerSpec`."""
    spec = conn.recv()
    try:
        reduce, runner, report = _load_shard(spec)
        conn.send(Ready(spec.rank, weight_bytes(runner.runtime), report.dequantized))
        _serve(conn, runner, torch.device(spec.device))
        del reduce
    except BaseException as exc:  # report, then end: rank 0 turns it into an unhealthy engine
        with contextlib.suppress(OSError, ValueError):
            conn.send(Failed(spec.rank, repr(exc), traceback.format_exception(exc)))
        raise SystemExit(1) from None
    finally:
        conn.close()
