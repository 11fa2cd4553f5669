"""A job's updates as a route answers them: errors to HTTP statuses, the disconnect watch, stream chunks.

The single-choice path (:mod:`pagedgen.server.serving`) and the ``n > 1`` path
(:mod:`pagedgen.server.choices`) consume a job's :class:`~pagedgen.server.worker.JobUpdate` the same way;
what they share lives here, below both, so neither imports the other's route. docs/server.md, "How it
works", has the whole flow.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from fastapi.responses import Response
from starlette.types import Receive

from pagedgen.engine.events import EngineErrorCode
from pagedgen.llm import finish_reason_text, is_engine_failure
from pagedgen.sampling.logprobs import TokenLogprob
from pagedgen.server.admission import RETRY_AFTER_S
from pagedgen.server.guard import ApiError, error_body
from pagedgen.server.metrics import ServerMetrics
from pagedgen.server.responses import Payload, PayloadBuilder
from pagedgen.server.worker import JobError, JobUpdate

if TYPE_CHECKING:
    from pagedgen.core.json_value import JsonObject

JOB_STATUS = {
    JobError.INVALID: 400,
    JobError.UNAVAILABLE: 503,
    JobError.SHUTDOWN: 503,
    JobError.INTERNAL: 500,
}
SHUTTING_DOWN = {"Retry-After": str(RETRY_AFTER_S), "Connection": "close"}  # a draining server's 503
T = TypeVar("T")


class ClientGone(enum.Enum):
    """What :func:`unless_disconnected` returns when the client left first."""

    GONE = "gone"


CLIENT_GONE = ClientGone.GONE


class Cancellable(Protocol):
    """A job's asyncio end (one job's handle, or the group of a request's ``n`` jobs)."""

    def cancel(self) -> None: ...


def client_gone(jobs: Cancellable, metrics: ServerMetrics) -> Response:
    jobs.cancel()
    metrics.on_disconnect()
    return Response(status_code=499)  # nginx's "client closed request": nobody reads it


async def unless_disconnected(work: Coroutine[Any, Any, T], receive: Receive) -> T | ClientGone:
    """The result of ``work``, or ``CLIENT_GONE`` if the client disconnects first.

    Starlette only notices disconnects of streaming responses; without this watch, a client that gives up
    on a long non-streaming completion would keep its turn generating (and its blocks held) to the end.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        done, _pending = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        return task.result() if task in done else CLIENT_GONE
    finally:
        task.cancel()
        watcher.cancel()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def raise_for(update: JobUpdate) -> None:
    """Raise the :class:`ApiError` of a refused job or a failed turn; nothing for a good update."""
    if update.error is not None:
        headers = SHUTTING_DOWN if update.error is JobError.SHUTDOWN else None
        raise ApiError(JOB_STATUS[update.error], update.message, code=update.error.value, headers=headers)
    finish = update.finish
    if finish is not None and finish_reason_text(finish.reason) == "failed":
        if finish.error_code is EngineErrorCode.REQUEST_UNSERVICEABLE:
            raise ApiError(
                400, "the request can never fit the engine's KV cache", code="request_unserviceable"
            )
        if is_engine_failure(finish.error_code):
            raise ApiError(503, f"the engine failed ({finish.error_code.value})", code="unhealthy")
        if finish.error_code is EngineErrorCode.GUIDANCE_FAILED:  # the request's constraint, not a bug
            message = f"the output constraint failed during generation: {finish.error_message}"
            raise ApiError(400, message, code="guidance_failed")
        raise ApiError(500, f"generation failed ({finish.error_code.value})")


async def chunk(
    builder: PayloadBuilder, text: str, logprobs: Sequence[TokenLogprob], reason: str | None
) -> Payload | None:
    """One stream chunk; built in a worker thread when it decodes logprob tokens (up to 21 per token)."""
    if not logprobs:
        return builder.chunk(text, logprobs, reason)
    return await asyncio.to_thread(builder.chunk, text, logprobs, reason)


def error_json_body(exc: ApiError) -> JsonObject:
    return error_body(exc.status, exc.message, exc.param, exc.code)
