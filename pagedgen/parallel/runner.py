"""Rank 0's side of tensor parallelism: the engine's execute phase over T ranks.

:class:`TensorParallelRunner` stands where :class:`pagedgen.executor.runner.ModelRunner` stands (the same
``device``, ``execute``, ``adapt_gemm`` and ``release``), so the engine's scheduler, sampler and step
transaction are the single-rank ones, unchanged, in the engine's process. Each step it checks the step's
slots, sends the packed inputs to every other rank (local processes or Ray actors, one connection each:
:mod:`pagedgen.parallel.launch`) and runs its own shard's forward; the row-parallel layers' all-reduces
keep the ranks in lockstep. Only rank 0 computes logits.

Why the transaction needs nothing more: a step that fails before ``execute`` sends nothing, and the K/V a
rolled-back step wrote lie in slots that the cache manager discards on every rank alike. A failure after
the inputs went out (a rank died, a collective timed out, rank 0 itself failed mid-forward) leaves the
ranks out of step, so it is a :class:`RankFailedError`: fatal, the engine becomes unhealthy, and every
later ``execute`` raises the same at once. A worker's death is seen before the next step (its process has
exited) or inside it (the collective fails at once when its sockets close); a hung rank fails the
collective after the group's timeout. Nothing waits forever.

On the CPU each rank gets ``cpus // T`` threads, rank 0 included (a process-wide setting, held through the
counted guard of :mod:`pagedgen.parallel.threads` and given back by ``release``): more threads than cores
across the ranks makes their spinning pools fight.
"""

from __future__ import annotations

import threading
import weakref
from multiprocessing.connection import Connection
from typing import Any

import torch

from pagedgen.core.decoder import DecoderModel
from pagedgen.executor.runner import ModelRunner
from pagedgen.ops.matmul.gemm_threads import usable_cpus
from pagedgen.parallel.comm import DEFAULT_TIMEOUT_S, join_group, serve_store
from pagedgen.parallel.launch import (
    Launcher,
    LocalLauncher,
    Placement,
    RankFailedError,
    RankLauncher,
    RankProcess,
    stop_ranks,
)
from pagedgen.parallel.messages import AdaptGemm, Done, Failed, Ready, StepMessage
from pagedgen.parallel.plan import TensorParallelError
from pagedgen.parallel.shard import check_family, plan_for, shard_llama, weight_bytes
from pagedgen.parallel.threads import cpu_threads
from pagedgen.parallel.worker import ModelSource, ShardedModel, WorkerSpec

STARTUP_TIMEOUT_S = 600.0  # a worker loads the whole checkpoint before it cuts its shard


__all__ = ["RankFailedError", "TensorParallelRunner"]


def make_launcher(launcher: Launcher, placement: Placement, device: torch.device, world: int) -> RankLauncher:
    """The launcher of ``launcher``'s kind; a Ray one reserves its placement group here (raises
    :class:`TensorParallelError` when the cluster cannot place it). Ray is imported only for ``ray``."""
    if launcher is Launcher.LOCAL:
        return LocalLauncher()
    from pagedgen.parallel.ray_ranks import RayLauncher

    return RayLauncher(world, device, placement)


class _Worker:
    """One rank other than 0: its process (a subprocess or a Ray actor) and rank 0's end of its connection."""

    def __init__(self, rank: int, process: RankProcess, conn: Connection):
        self.rank, self.process, self.conn = rank, process, conn

    def failure(self, wait_s: float = 0.0) -> str | None:
        """Why this rank is gone (its last message, or how it ended), or ``None`` while it lives."""
        closed = False
        try:
            if self.conn.poll(wait_s):
                message = self.conn.recv()
                if isinstance(message, Failed):
                    return f"tensor-parallel rank {self.rank} failed: {message.error}"
        except (EOFError, OSError):
            closed = True
        reason = self.process.exit_reason()
        if reason is not None:
            return f"tensor-parallel rank {self.rank} ({self.process.label}) {reason}"
        if closed:
            return f"tensor-parallel rank {self.rank} ({self.process.label}) closed its connection"
        return None


def _model_source(model: Any) -> ModelSource:
    checkpoint = getattr(model, "checkpoint", None)
    if checkpoint is None or not hasattr(model, "weights_format"):
        raise TensorParallelError(
            f"tensor parallelism needs a pagedgen.Model loaded from a checkpoint (each rank loads its own "
            f"shard), got {type(model).__name__}"
        )
    return ModelSource(str(checkpoint.source), model.dtype, model.weights_format.value, model.activations)


class TensorParallelRunner:
    """The execute phase over ``world`` ranks; ``model`` is the engine's ``pg.Model`` (not changed).

    ``launcher`` starts ranks ``1..world-1`` as local processes or Ray actors (``placement``: the Ray
    placement group's strategy; :mod:`pagedgen.parallel.launch`). Raises :class:`TensorParallelError` for a
    model outside the Llama family, sizes that do not split or a placement the cluster cannot make, and
    :class:`RankFailedError` when a worker fails to start (its error in the message).
    """

    def __init__(
        self,
        model: DecoderModel,
        world: int,
        num_blocks: int,
        block_size: int,
        window_blocks: int | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        launcher: Launcher | str = Launcher.LOCAL,
        placement: Placement | str = Placement.STRICT_PACK,
    ):
        config = getattr(model, "config", None)
        family = getattr(config, "architecture", type(model).__name__)  # a model without a config: its type
        check_family(getattr(model, "runtime", None), family, world)
        source = _model_source(model)
        shards = plan_for(model.runtime, world)  # refuses sizes that do not split, before any process starts
        self.world = world
        self.device = torch.device(model.device)
        self.launcher = make_launcher(Launcher(launcher), Placement(placement), self.device, world)
        ranks: list[tuple[RankProcess, Connection]] = []  # the finalizer's: each rank joins as it starts
        self._finalizer = weakref.finalize(self, stop_ranks, ranks, self.launcher)
        threads = max(1, usable_cpus() // world) if self.device.type == "cpu" else None
        self._threads = None if threads is None else cpu_threads.acquire(threads)
        self._broken: str | None = None
        self._workers: list[_Worker] = []
        try:
            store, address = serve_store(world, timeout_s, self.launcher.host)
            for rank in range(1, world):
                device = self.launcher.worker_device(self.device, rank)
                geometry = (num_blocks, block_size, window_blocks)
                spec = WorkerSpec(rank, address, source, device, *geometry, threads)
                process, conn = self.launcher.start(rank)
                self._workers.append(_Worker(rank, process, conn))
                ranks.append((process, conn))
                conn.send(spec)
            self._reduce = self._join(address, store)
            runtime, report = shard_llama(model.runtime, shards[0], self._reduce)
            view = ShardedModel(runtime, self.device, int(model.vocab_size), int(model.max_context))
            self._inner = ModelRunner(view, num_blocks, block_size, window_blocks, cuda_graphs=False)
            ready = [self._await_ready(w) for w in self._workers]
        except BaseException:
            self._finalizer()
            self._restore_threads()
            raise
        self.rank_weight_bytes = (weight_bytes(runtime), *(r.weight_bytes for r in ready))
        self.dequantized_slices = (report.dequantized, *(r.dequantized_slices for r in ready))
        self.vocab_size = self._inner.vocab_size

    def _join(self, address, store):
        """Rank 0's side of the rendezvous, watching the workers: one that dies first fails it at once."""
        joined: list = []
        thread = threading.Thread(
            target=lambda: joined.append(join_group(address, 0, self.device, store)), daemon=True
        )
        thread.start()
        while thread.is_alive():
            thread.join(0.5)
            for worker in self._workers:
                reason = worker.failure()
                if reason is not None:
                    raise RankFailedError(f"{reason} before joining the group")
        if not joined:
            raise RankFailedError("the tensor-parallel rendezvous failed (see the log for the store error)")
        return joined[0]

    def _await_ready(self, worker: _Worker) -> Ready:
        waited = 0.0
        while waited < STARTUP_TIMEOUT_S:
            try:
                message = worker.conn.recv() if worker.conn.poll(1.0) else None
            except (EOFError, OSError):
                raise RankFailedError(
                    worker.failure() or f"tensor-parallel rank {worker.rank} did not start"
                ) from None
            if isinstance(message, Ready):
                return message
            if isinstance(message, Failed):
                raise RankFailedError(
                    f"tensor-parallel rank {worker.rank} failed to start: {message.error}\n"
                    + "".join(message.details)
                )
            if message is None and worker.process.exit_reason() is not None:
                raise RankFailedError(worker.failure() or f"tensor-parallel rank {worker.rank} did not start")
            waited += 1.0
        raise RankFailedError(
            f"tensor-parallel rank {worker.rank} was not ready after {STARTUP_TIMEOUT_S:.0f} s"
        )

    # -- the runner's interface -----------------------------------------------------------------------

    @property
    def kv_cache(self):
        """Rank 0's KV cache (only its KV heads)."""
        return self._inner.kv_cache

    def adapt_gemm(self, max_batch_size: int, max_scheduled_tokens: int, chunk_size: int | None) -> None:
        """Every rank picks its GEMM tables for its own shapes, one after the other (they share a cache)."""
        self._inner.adapt_gemm(max_batch_size, max_scheduled_tokens, chunk_size)
        for worker in self._workers:
            self._send(worker, AdaptGemm(max_batch_size, max_scheduled_tokens, chunk_size))
            if not worker.conn.poll(STARTUP_TIMEOUT_S) or not isinstance(worker.conn.recv(), Done):
                self._fail(worker.failure(1.0) or f"tensor-parallel rank {worker.rank} did not adapt")

    def execute(self, inputs) -> torch.Tensor:
        """Run the step on every rank; rank 0's logits ``[len(inputs.logits_rows), vocab]``.

        Raises ``IndexError`` (nothing sent, nothing written) for a slot outside the cache, and
        :class:`RankFailedError` once any rank is gone or the ranks may be out of step.
        """
        if self._broken is not None:
            raise RankFailedError(self._broken)
        self._inner.check_slots(inputs)
        message = StepMessage.from_inputs(inputs)
        for worker in self._workers:
            self._send(worker, message)
        try:
            return self._inner.execute(inputs)
        except Exception as exc:
            reasons = [r for r in (w.failure(1.0) for w in self._workers) if r is not None]
            self._fail(
                "; ".join(reasons) or f"rank 0 failed mid-step, the ranks are out of step: {exc!r}", exc
            )

    def _send(self, worker: _Worker, command: object) -> None:
        reason = worker.failure()
        if reason is None:
            try:
                worker.conn.send(command)
                return
            except (OSError, ValueError) as exc:
                reason = worker.failure(1.0) or f"tensor-parallel rank {worker.rank} is unreachable: {exc!r}"
        self._fail(reason)

    def _fail(self, reason: str, cause: BaseException | None = None):
        self._broken = reason
        raise RankFailedError(reason) from cause

    def release(self) -> None:
        """Stop every worker, remove the launcher's placement (Ray) and drop the KV storage (engine
        teardown). Idempotent."""
        self._finalizer()
        self._inner.release()
        self._restore_threads()

    def _restore_threads(self) -> None:
        """Give this runner's thread count back to the process-wide guard (``pagedgen.parallel.threads``)."""
        if self._threads is not None:
            cpu_threads.release(self._threads)

    @property
    def worker_pids(self) -> tuple[int, ...]:
        """The local worker processes' ids (``launcher="local"``)."""
        return tuple(w.process.pid for w in self._workers)
