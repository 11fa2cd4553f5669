"""``n > 1``: several choices of one prompt, served as ``n`` engine jobs that compute the prompt once.

Choice ``i`` is its own engine request, submitted in index order right after the others, so the prefix
cache shares the prompt's full blocks (choice ``i`` seeded ``seed + i``); the choices succeed or fail
together, and a stream interleaves their chunks. docs/server.md, "Several choices (n > 1)", has the rules,
the usage accounting and the cost.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import Response

from pagedgen.llm import finish_reason_text
from pagedgen.models.tokenizer import IncrementalDetokenizer
from pagedgen.sampling.logprobs import TokenLogprob
from pagedgen.sampling.options import SEED_MAX
from pagedgen.sampling.params import SamplingParams
from pagedgen.server.admission import Ticket
from pagedgen.server.guard import ApiError, request_id_of
from pagedgen.server.metrics import ServerMetrics
from pagedgen.server.responses import PayloadBuilder, usage_dict
from pagedgen.server.sse import DONE, EventStreamResponse, sse_event
from pagedgen.server.updates import (
    CLIENT_GONE,
    chunk,
    client_gone,
    error_json_body,
    raise_for,
    unless_disconnected,
)
from pagedgen.server.worker import Finish, JobUpdate
from pagedgen.server.worker_protocol import ServingWorker

if TYPE_CHECKING:
    from pagedgen.core.json_value import JsonObject
    from pagedgen.server.app import _Server
    from pagedgen.server.protocol import RequestBody

log = logging.getLogger("pagedgen.server")


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request seeded ``seed``: ``seed + index``, wrapped into the
    engine's 64-bit range (the sampler reduces seeds mod 2**64), so no two choices share a stream."""
    if seed is None:
        return None
    derived = seed + index
    return derived - (1 << 64) if derived > SEED_MAX else derived


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    return [dataclasses.replace(params, seed=choice_seed(params.seed, i)) for i in range(n)]


class JobGroup:
    """The asyncio end of a request's ``n`` jobs: ``next()`` yields ``(index, update)`` as the worker sends
    them (each job's updates in order); ``cancel()`` cancels every unfinished job and is idempotent."""

    def __init__(self, worker: ServingWorker, n: int):
        self._worker = worker
        self._updates: asyncio.Queue[tuple[int, JobUpdate]] = asyncio.Queue()
        self._backlog: deque[tuple[int, JobUpdate]] = deque()
        self._job_ids: list[int] = []
        self._finished = [False] * n

    @classmethod
    def submit(
        cls,
        worker: ServingWorker,
        prompt_ids: Sequence[int],
        params: Sequence[SamplingParams],
        arrived_at: float,
        tag: str,
    ) -> JobGroup:
        """Submit one job per choice, in index order (choice 0 first, so it is the one that prefills)."""
        group = cls(worker, len(params))
        loop = asyncio.get_running_loop()
        for index, choice in enumerate(params):

            def sink(update: JobUpdate, index: int = index) -> None:
                loop.call_soon_threadsafe(group._updates.put_nowait, (index, update))

            group._job_ids.append(worker.submit(prompt_ids, choice, sink, arrived_at, tag))
        return group

    @property
    def n(self) -> int:
        return len(self._finished)

    @property
    def done(self) -> bool:
        return all(self._finished)

    async def next(self) -> tuple[int, JobUpdate]:
        item = self._backlog.popleft() if self._backlog else await self._updates.get()
        if item[1].final:
            self._finished[item[0]] = True
        return item

    async def started(self) -> JobUpdate | None:
        """Wait for every job's first update; the first refusal among them, or None when all started.

        Later updates of jobs that started meanwhile are kept for ``next()``, in order."""
        waiting = set(range(self.n))
        held: list[tuple[int, JobUpdate]] = []
        try:
            while waiting:
                index, update = await self._updates.get()
                if index not in waiting:
                    held.append((index, update))
                    continue
                waiting.discard(index)
                if update.error is not None:
                    self._finished[index] = True
                    return update
        finally:
            self._backlog.extend(held)
        return None

    def cancel(self) -> None:
        for index, job_id in enumerate(self._job_ids):
            if not self._finished[index]:
                self._finished[index] = True
                self._worker.cancel(job_id)


async def run_choices(
    server: _Server,
    body: RequestBody,
    params: SamplingParams,
    ids: list[int],
    builder: PayloadBuilder,
    arrived: float,
    request: Request,
    ticket: Ticket,
) -> Response | JsonObject:
    """Serve a validated request's ``body.n`` choices (the route's ``_run_job`` for ``n > 1``)."""
    tag = request_id_of(request.scope) or ""
    group = JobGroup.submit(server.client.worker, ids, choice_params(params, body.n), arrived, tag)
    try:
        refusal = await unless_disconnected(group.started(), request.receive)
        if refusal is CLIENT_GONE:
            return client_gone(group, server.metrics)
        if refusal is not None:
            raise_for(refusal)
    except BaseException:
        group.cancel()
        raise
    builders = [builder] + [builder.sibling() for _ in range(body.n - 1)]
    texts = [IncrementalDetokenizer(server.tokenizer, body.skip_special_tokens) for _ in range(body.n)]
    if body.stream:
        close = _close_stream(group, ticket, server.metrics)
        return EventStreamResponse(_stream(group, texts, builders, server.metrics, tag), on_close=close)
    try:
        collected = await unless_disconnected(_collect(group, texts, builders), request.receive)
        if collected is CLIENT_GONE:
            return client_gone(group, server.metrics)
        for reason in collected[1]:
            server.metrics.on_success(reason)
        return collected[0]
    finally:
        group.cancel()  # the other choices of a failed one, or a handler interrupted


def _close_stream(group: JobGroup, ticket: Ticket, metrics: ServerMetrics) -> Callable[[], None]:
    def close() -> None:
        if not group.done:
            group.cancel()
            metrics.on_disconnect()
        ticket.release()

    return close


def _usage_finish(finishes: Sequence[Finish]) -> Finish:
    """One ``Finish`` whose usage is the request's: the prompt once, the completions summed."""
    return dataclasses.replace(finishes[0], generated_tokens=sum(f.generated_tokens for f in finishes))


def _indexed(payload: JsonObject, index: int) -> JsonObject:
    for choice in payload["choices"]:
        choice["index"] = index
    return payload


async def _collect(
    group: JobGroup, texts: list[IncrementalDetokenizer], builders: list[PayloadBuilder]
) -> tuple[JsonObject, list[str]]:
    """The whole response (choices ordered by index) and each choice's engine finish reason."""
    n = group.n
    parts: list[list[str]] = [[] for _ in range(n)]
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
    finishes: list[Finish | None] = [None] * n
    while None in finishes:
        index, update = await group.next()
        raise_for(update)
        parts[index].append(await asyncio.to_thread(texts[index].add, update.tokens))
        logprobs[index].extend(update.logprobs)
        if update.finish is not None:
            parts[index].append(await asyncio.to_thread(texts[index].flush) + update.finish.text_before_stop)
            finishes[index] = update.finish
    done = [f for f in finishes if f is not None]
    reasons = [finish_reason_text(f.reason) for f in done]
    choices = []
    for index, builder in enumerate(builders):
        text = "".join(parts[index])
        full = await asyncio.to_thread(builder.full, text, logprobs[index], reasons[index], done[index])
        choices.extend(_indexed(full, index)["choices"])
    full["choices"] = choices
    full["usage"] = usage_dict(_usage_finish(done))
    return full, reasons


async def _stream(
    group: JobGroup,
    texts: list[IncrementalDetokenizer],
    builders: list[PayloadBuilder],
    metrics: ServerMetrics,
    request_id: str,
) -> AsyncIterator[bytes]:
    """SSE chunks of every choice, interleaved as they come; cancels what is left if the stream ends early."""
    try:
        for index, builder in enumerate(builders):
            first = builder.first_chunk()
            if first is not None:
                yield sse_event(_indexed(first, index))
        finishes: list[Finish | None] = [None] * group.n
        while None in finishes:
            index, update = await group.next()
            try:
                raise_for(update)
            except ApiError as exc:
                metrics.on_error_status(exc.status)
                if exc.status >= 500:
                    log.error("request %s failed with %d: %s", request_id, exc.status, exc.message)
                group.cancel()  # the whole request fails: its other choices stop here
                yield sse_event(error_json_body(exc))
                break
            builder, finish = builders[index], update.finish
            delta = await asyncio.to_thread(texts[index].add, update.tokens)
            if finish is None:
                if delta or update.logprobs:
                    piece = await chunk(builder, delta, update.logprobs, None)
                    if piece is not None:  # None: the builder holds the text until the turn ends
                        yield sse_event(_indexed(piece, index))
                continue
            delta += await asyncio.to_thread(texts[index].flush) + finish.text_before_stop
            reason = finish_reason_text(finish.reason)
            last = await chunk(builder, delta, update.logprobs, reason)
            if last is not None:
                yield sse_event(_indexed(last, index))
            metrics.on_success(reason)
            finishes[index] = finish
        else:
            if builders[0].include_usage:
                done = [f for f in finishes if f is not None]
                yield sse_event(builders[0].usage_chunk(_usage_finish(done)))
        yield DONE
    finally:
        left_early = not group.done
        group.cancel()
        if left_early:
            metrics.on_disconnect()
