"""The ingress's engine: the single server's worker interface, served by the replica deployment.

:func:`pagedgen.server.app.create_app` drives a :class:`~pagedgen.server.worker_protocol.ServingWorker`
(``submit`` / ``cancel`` / ``release`` / ``snapshot`` / ``healthy`` / ``start`` / ``shutdown`` / ``abort``);
the single server's is the :class:`~pagedgen.server.worker.EngineWorker`. :class:`ReplicaSetWorker` fills
the same role over a Serve handle, so the routes, parameters, errors,
streaming and admission are the single server's own code. A job is one streaming ``generate`` call, routed
by :class:`~pagedgen.server.replicas.router.CacheAffinityRouter`; its updates go to the job's sink as they
arrive. A replica that dies mid-job ends the job with ``unhealthy`` (a 503, or an error event in a stream)
instead of leaving it waiting; Serve starts a replacement and later jobs go to live replicas.

Counters come from a poll thread that asks every live replica for its :class:`ReplicaStats` once per
``poll_s``; ``snapshot`` (their sum) and ``healthy`` read the last poll, never waiting, as the single
server's ``/health`` and ``/metrics`` read the engine thread's last publication.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import fields

from ray.serve.handle import DeploymentHandle

from pagedgen.llm import SamplingParams
from pagedgen.server.replicas.messages import ReplicaJob, ReplicaStats, ReplicaTarget
from pagedgen.server.replicas.registry import live_replicas
from pagedgen.server.replicas.setup import ModelCard
from pagedgen.server.worker import SHUTDOWN_MESSAGE, EngineSnapshot, JobError, JobUpdate, Keep, Sink

log = logging.getLogger("pagedgen.server")

REPLICA_LOST_MESSAGE = "the replica serving this request stopped; retry the request"
NO_REPLICA_MESSAGE = "no replica of the engine is running"
POLL_S = 1.0
CALL_TIMEOUT_S = 10.0  # a stats call to a replica that died meanwhile


def _call_context() -> contextvars.Context:
    """An empty context for a job's task, so its handle call gets its own Serve request ids.

    A handle call made in the context of an HTTP request Serve is serving takes that request's internal id,
    and Serve's router matches a routed replica to its waiting call by that id: the several jobs of one
    request (``n`` choices, a batch of prompts) would share one, and all but one would wait forever. In an
    empty context there is no request context to inherit, so Serve gives each call fresh ids (Ray 2.60's
    ``get_request_metadata``), with no private Serve call. The job's tag still names the HTTP request in the
    replica's log lines."""
    return contextvars.Context()


def total_snapshot(snapshots: Sequence[EngineSnapshot]) -> EngineSnapshot:
    """The application's counters: every replica's summed; healthy while any replica is."""
    counts = {f.name: sum(getattr(s, f.name) for s in snapshots) for f in fields(EngineSnapshot)}
    counts["healthy"] = any(s.healthy for s in snapshots)
    return EngineSnapshot(**counts)


class ReplicaSetWorker:
    """A :class:`~pagedgen.server.worker_protocol.ServingWorker` whose engine is the replica deployment
    behind ``handle``.

    ``max_batch_size`` is the application's: one replica's batch times the most replicas that may run, so the
    single server's admission rule (429 past running plus ``max_queued_requests``) holds for the whole set.
    ``submit`` and ``cancel`` run on the serving event loop (as the routes call them)."""

    def __init__(
        self, handle: DeploymentHandle, model: ModelCard, app_name: str, deployment: str, max_batch_size: int
    ):
        self._handle = handle
        self._model = model
        self._app_name = app_name
        self._deployment = deployment
        self._max_batch_size = max_batch_size
        self._ids = itertools.count(1)
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._stats: dict[str, ReplicaStats] = {}
        self._aborted = False
        self._stopped = threading.Event()
        self._poller = threading.Thread(target=self._poll_loop, name="pagedgen-replica-poll", daemon=True)
        self._releases: queue.SimpleQueue[str | None] = queue.SimpleQueue()  # None: stop
        self._releaser = threading.Thread(
            target=self._release_loop, name="pagedgen-replica-release", daemon=True
        )

    # ------------------------------------------------------------ the worker interface

    @property
    def model(self) -> ModelCard:
        """The model's card (no weights: the replicas hold those), which the parameter checks read."""
        return self._model

    @property
    def max_batch_size(self) -> int:
        return self._max_batch_size

    @property
    def snapshot(self) -> EngineSnapshot:
        return total_snapshot([stats.snapshot for stats in self._stats.values()])

    @property
    def healthy(self) -> bool:
        return any(stats.healthy for stats in self._stats.values())

    @property
    def error(self) -> str | None:
        return None if self.healthy else NO_REPLICA_MESSAGE

    @property
    def replica_stats(self) -> dict[str, ReplicaStats]:
        """The last poll's stats of each live replica, by its unique id."""
        return dict(self._stats)

    def start(self) -> None:
        """Wait for a first replica's answer (which also builds this process's router), then poll."""
        self._handle.stats.remote(ReplicaTarget()).result()
        self.poll()
        self._poller.start()
        self._releaser.start()

    def shutdown(self) -> None:
        self._stopped.set()
        self._releases.put(None)
        for thread in (self._poller, self._releaser):
            if thread.is_alive():
                thread.join()

    def abort(self) -> None:
        """End every job in flight with ``shutting_down`` and refuse later ones (a drain that ran out)."""
        self._aborted = True
        for task in list(self._tasks.values()):
            task.cancel()

    def sync(self, reply: Callable[[EngineSnapshot], None]) -> None:
        reply(self.snapshot)

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        sink: Sink,
        arrived_at: float,
        tag: str = "",
        keep: Keep | None = None,
    ) -> int:
        job_id = next(self._ids)
        if self._aborted:
            sink(JobUpdate(error=JobError.SHUTDOWN, message=SHUTDOWN_MESSAGE))
            return job_id
        job = ReplicaJob(tuple(prompt_ids), params, time.monotonic() - arrived_at, tag, keep)
        task = asyncio.get_running_loop().create_task(self._relay(job_id, job, sink), context=_call_context())
        self._tasks[job_id] = task
        return job_id

    def release(self, key: str) -> None:
        """Close the Request kept under ``key`` (a stored response's). Which replica holds it is not known
        here, so every live replica is told, by the release thread (one, draining a queue in order) so the
        caller never waits; the others hold nothing under the key, and a follow-up that lands elsewhere
        starts a fresh Request."""
        self._releases.put(key)

    def _release_loop(self) -> None:
        while (key := self._releases.get()) is not None:
            self._release_everywhere(key)

    def _release_everywhere(self, key: str) -> None:
        for name in live_replicas(self._app_name, self._deployment):
            try:
                self._handle.release.remote(ReplicaTarget(name), key).result(timeout_s=CALL_TIMEOUT_S)
            except Exception as exc:  # a replica that died meanwhile holds nothing any more
                log.info("replica %s did not answer its release call: %r", name, exc)

    def cancel(self, job_id: int) -> None:
        task = self._tasks.pop(job_id, None)
        if task is not None:
            task.cancel()

    # ------------------------------------------------------------ jobs

    async def _relay(self, job_id: int, job: ReplicaJob, sink: Sink) -> None:
        """Pass the replica's updates to ``sink``; a lost replica ends the job with ``unhealthy``."""
        final = False
        stream = self._handle.options(stream=True).generate.remote(job)
        try:
            async for update in stream:
                sink(update)
                if update.final:
                    final = True
                    break
            if not final:
                sink(JobUpdate(error=JobError.UNAVAILABLE, message=REPLICA_LOST_MESSAGE))
        except asyncio.CancelledError:
            stream.cancel()  # Serve cancels the replica's generate: its job is cancelled there
            if self._aborted:
                sink(JobUpdate(error=JobError.SHUTDOWN, message=SHUTDOWN_MESSAGE))
            raise
        except Exception as exc:  # the replica died or became unreachable mid-job
            log.warning("request %s: its replica failed: %r", job.tag or "?", exc)
            sink(JobUpdate(error=JobError.UNAVAILABLE, message=REPLICA_LOST_MESSAGE))
        finally:
            self._tasks.pop(job_id, None)

    # ------------------------------------------------------------ counters

    def poll(self) -> None:
        """Ask every live replica for its stats now; a replica that does not answer is dropped."""
        fresh: dict[str, ReplicaStats] = {}
        for name in live_replicas(self._app_name, self._deployment):
            try:
                stats = self._handle.stats.remote(ReplicaTarget(name)).result(timeout_s=CALL_TIMEOUT_S)
            except Exception as exc:
                log.info("replica %s did not answer its stats call: %r", name, exc)
                continue
            fresh[stats.replica] = stats
        self._stats = fresh

    def _poll_loop(self) -> None:
        while not self._stopped.wait(POLL_S):
            try:
                self.poll()
            except Exception:  # the poll must outlive one bad round
                log.exception("polling the replicas failed")
