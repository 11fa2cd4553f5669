"""The engine behind the HTTP app, as the app drives it: one role, two implementations.

:func:`pagedgen.server.app.create_app` serves the API over any :class:`ServingWorker`. The single server's
is :class:`~pagedgen.server.worker.EngineWorker` (the engine on an owner thread of this process); the
replicated server's is :class:`~pagedgen.server.replicas.client.ReplicaSetWorker` (the engines of a Ray
Serve deployment). Both take the same jobs and publish the same records (``JobUpdate`` to a job's sink,
an ``EngineSnapshot`` of counters), so the routes, parameters, errors, streaming and admission
are one implementation whichever engine runs under them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from pagedgen.llm import ModelView, SamplingParams
from pagedgen.server.worker import EngineSnapshot, Keep, Sink


class ServingWorker(Protocol):
    """What the app needs from its engine. ``submit``, ``cancel`` and ``release`` are called on the serving
    event loop and never wait for the engine; ``snapshot``, ``healthy`` and ``error`` are plain reads of the
    last publication; ``start`` and ``shutdown`` run in a thread of the app's lifespan."""

    @property
    def model(self) -> ModelView:
        """What the parameter checks read of the served model off the engine (the loaded model itself, or
        the replicated ingress's card of it)."""
        ...

    @property
    def max_batch_size(self) -> int:
        """How many jobs run at once: admission's running capacity."""
        ...

    @property
    def snapshot(self) -> EngineSnapshot: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def error(self) -> str | None: ...

    def start(self) -> None: ...

    def shutdown(self) -> None: ...

    def abort(self) -> None:
        """End every job in flight with ``SHUTDOWN`` and refuse later ones (a drain that ran out)."""
        ...

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        sink: Sink,
        arrived_at: float,
        tag: str = "",
        keep: Keep | None = None,
    ) -> int:
        """Queue one turn; its updates go to ``sink``, the final one last. Returns the job's id."""
        ...

    def release(self, key: str) -> None:
        """Close the Request kept under ``key``, if one is."""
        ...

    def cancel(self, job_id: int) -> None: ...

    def sync(self, reply: Callable[[EngineSnapshot], None]) -> None: ...
