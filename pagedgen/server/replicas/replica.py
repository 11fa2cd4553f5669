"""One replica of the replicated application: a Serve deployment that owns one engine.

It runs the single server's :class:`~pagedgen.server.worker.EngineWorker` (the engine's owner thread) and
its :class:`~pagedgen.server.metrics.ServerMetrics`, and answers two calls from the ingress: ``generate``
streams one job's :class:`~pagedgen.server.worker.JobUpdate` records (the worker's own), and ``stats``
returns the published counters and metrics. A generate call that Serve cancels (the client left) cancels
the job, freeing its blocks. ``check_health`` fails once the engine is unhealthy, so Serve replaces the
replica; shutting the replica down shuts its worker down (its jobs end with ``shutting_down``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from ray import serve

from pagedgen.engine.config import EngineConfig
from pagedgen.server.app import ServerOptions
from pagedgen.server.metrics import ServerMetrics
from pagedgen.server.replicas.messages import ReplicaJob, ReplicaStats, ReplicaTarget
from pagedgen.server.replicas.setup import ModelSource
from pagedgen.server.worker import EngineWorker, JobUpdate


class EngineReplica:
    """The replica deployment's class (Serve builds one per replica process)."""

    def __init__(self, source: ModelSource, engine: EngineConfig, options: ServerOptions):
        model, _tokenizer = source.load()
        self._name = serve.get_replica_context().replica_id.unique_id
        self._metrics = ServerMetrics(options.model_name)
        self._worker = EngineWorker(
            model,
            engine,
            metrics=self._metrics,
            speculative=options.speculative,
            num_speculative_tokens=options.num_speculative_tokens,
        )
        self._worker.start()
        self._metrics.bind(
            snapshot=lambda: self._worker.snapshot, admitted=lambda: self._worker.snapshot.jobs
        )

    async def generate(self, job: ReplicaJob) -> AsyncIterator[JobUpdate]:
        """The job's updates in order, its final one last; cancelled (by Serve) before that, the job is."""
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[JobUpdate] = asyncio.Queue()
        arrived = time.monotonic() - job.waited_s
        job_id = self._worker.submit(
            job.prompt_ids,
            job.params,
            lambda u: loop.call_soon_threadsafe(updates.put_nowait, u),
            arrived,
            job.tag,
            job.keep,
        )
        final = False
        try:
            while not final:
                update = await updates.get()
                final = update.final
                yield update
        finally:
            if not final:
                self._worker.cancel(job_id)

    def release(self, _target: ReplicaTarget, key: str) -> None:
        """Close the Request this replica keeps under ``key``, if it keeps one."""
        self._worker.release(key)

    def stats(self, _target: ReplicaTarget) -> ReplicaStats:
        return ReplicaStats(self._name, self._worker.snapshot, self._metrics.render(), self._worker.healthy)

    def check_health(self) -> None:
        if not self._worker.healthy:
            raise RuntimeError(self._worker.error or "the engine is unhealthy")

    def __del__(self) -> None:
        worker = getattr(self, "_worker", None)
        if worker is not None:
            worker.shutdown()
