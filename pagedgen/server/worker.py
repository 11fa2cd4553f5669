"""The engine's owner thread: every Engine and Request call of the server happens here.

The reference's single-owner rule ("Other host threads marshal commands and copied inputs to that owner")
shapes this module. HTTP handlers never touch the engine: they put immutable commands (submit a prompt,
cancel a job, sync) on a thread-safe queue. The owner thread loops: take every queued command (blocking only
when the engine has no work), run one engine transaction, copy each affected job's tokens and finish into a
:class:`JobUpdate` and hand it to that job's sink. :class:`AsyncEngineClient` is the asyncio side: its sinks
push updates into per-job ``asyncio.Queue`` objects with ``loop.call_soon_threadsafe``.

A run that raises (or an event reporting an engine-level failure) makes the engine unhealthy for good: every
job in flight receives an ``UNAVAILABLE`` update, later submissions are refused the same way, and the server
answers 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedgen.engine.events import EngineErrorCode, EngineEventFlags, FinishReason
from pagedgen.errors import PagedGenError
from pagedgen.llm import SamplingParams, TokenLogprob, copy_logprobs, is_engine_failure

log = logging.getLogger("pagedgen.server")


class JobError(enum.Enum):
    """Why a job ended without a normal finish; the route maps each to an HTTP status."""

    INVALID = "invalid"  # the engine refused the parameters or the prompt (400)
    UNAVAILABLE = "unhealthy"  # the engine is unhealthy or shutting down (503)
    INTERNAL = "internal"  # an unexpected error while submitting (500)


@dataclass(frozen=True, slots=True)
class Finish:
    """A turn's terminal event, copied off the owner thread.

    The turn's text is the decode of its tokens followed by ``text_before_stop`` (see ``EngineEvent``).
    """

    reason: FinishReason
    prompt_tokens: int
    generated_tokens: int
    cached_prompt_tokens: int
    matched_stop_string_index: int | None
    error_code: EngineErrorCode
    text_before_stop: str = ""


@dataclass(slots=True)
class JobUpdate:
    """What one job learns from one owner-thread step: new tokens, and possibly its end.

    The first update of every job is either ``started`` (the turn was accepted) or carries ``error``.
    """

    started: bool = False
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: Finish | None = None
    error: JobError | None = None
    message: str = ""

    @property
    def final(self) -> bool:
        return self.finish is not None or self.error is not None


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """A copy of the engine's counters, published by the owner thread after every loop iteration."""

    total_blocks: int = 0
    free_blocks: int = 0
    resident_requests: int = 0
    queued_requests: int = 0
    steps: int = 0
    rollbacks: int = 0
    jobs: int = 0

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.free_blocks


Sink = Callable[[JobUpdate], None]


@dataclass(frozen=True, slots=True)
class _Submit:
    job_id: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    sink: Sink
    arrived_at: float


@dataclass(frozen=True, slots=True)
class _Cancel:
    job_id: int


@dataclass(frozen=True, slots=True)
class _Sync:
    reply: Callable[[EngineSnapshot], None]


@dataclass(frozen=True, slots=True)
class _Stop:
    pass


@dataclass(slots=True)
class _Job:
    """Owner-thread bookkeeping of one in-flight turn."""

    job_id: int
    request: Any
    turn_id: int
    sink: Sink
    arrived_at: float
    prompt_tokens: int
    first_token_at: float | None = None
    num_tokens: int = 0


class EngineWorker:
    """Owns one Engine on a dedicated thread and serves submit / cancel / sync commands from any thread.

    ``metrics`` (optional) receives ``on_started / on_tokens / on_finished / on_cancelled`` calls from the
    owner thread. ``start`` creates the engine on the new thread and re-raises its construction error.
    """

    def __init__(self, model: Any, engine_config: Any, *, metrics: Any = None, max_events: int = 256):
        self._model = model
        self._config = engine_config
        self._metrics = metrics
        self._max_events = max_events
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._ids = itertools.count(1)
        self._jobs: dict[int, _Job] = {}  # owner thread only
        self._by_request: dict[int, _Job] = {}  # id(request) -> job; owner thread only
        self._engine: Any = None
        self._buffer: Any = None
        self._snapshot = EngineSnapshot()
        self._error: str | None = None
        self._start_error: BaseException | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="pagedgen-engine", daemon=True)

    # ------------------------------------------------------------ any thread

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            raise self._start_error

    @property
    def healthy(self) -> bool:
        return self._error is None

    @property
    def error(self) -> str | None:
        return self._error

    @property
    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, sink: Sink, arrived_at: float) -> int:
        """Queue a one-turn job; its updates go to ``sink`` (called on the owner thread). Returns its id."""
        job_id = next(self._ids)
        self._commands.put(_Submit(job_id, tuple(prompt_ids), params, sink, arrived_at))
        return job_id

    def cancel(self, job_id: int) -> None:
        """Cancel the job's turn and close its request (its blocks return to the pool); no-op if finished."""
        self._commands.put(_Cancel(job_id))

    def sync(self, reply: Callable[[EngineSnapshot], None]) -> None:
        """Call ``reply(snapshot)`` once every command queued before this one has been applied."""
        self._commands.put(_Sync(reply))

    def shutdown(self) -> None:
        """Stop the owner thread: close every request and the engine, refuse jobs still in flight."""
        if self._thread.is_alive():
            self._commands.put(_Stop())
            self._thread.join()

    # ------------------------------------------------------------ owner thread

    def _main(self) -> None:
        try:
            from pagedgen.engine.engine import Engine

            self._engine = Engine(self._model, self._config)
            self._buffer = self._engine.create_event_buffer(self._max_events)
            self._publish()
        except BaseException as exc:  # reported to start()'s caller
            self._start_error = exc
            return
        finally:
            self._ready.set()
        try:
            while self._iterate():
                pass
        finally:
            self._teardown()

    def _iterate(self) -> bool:
        """One loop turn: apply commands, run one transaction if there is work, publish counters."""
        try:
            if not self._take_commands(block=not self._has_work()):
                return False
            if self._has_work():
                self._step()
            self._publish()
        except Exception as exc:  # a bug on the owner thread must not leave clients waiting forever
            self._fail(exc)
        return True

    def _has_work(self) -> bool:
        if self._error is not None:
            return False
        try:
            return self._engine.has_pending_requests()
        except Exception as exc:
            self._fail(exc)
            return False

    def _take_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one if ``block``); False once a stop command arrives."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            if isinstance(command, _Stop):
                return False
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, command: Any) -> None:
        if isinstance(command, _Submit):
            self._submit(command)
        elif isinstance(command, _Cancel):
            self._cancel(command.job_id)
        elif isinstance(command, _Sync):
            self._publish()
            command.reply(self._snapshot)

    def _submit(self, command: _Submit) -> None:
        if self._error is not None:
            _deliver(command.sink, JobUpdate(error=JobError.UNAVAILABLE, message=self._error))
            return
        request = None
        try:
            request = self._engine.create_request(command.params.generator_params(self._model), _options())
            turn_id = request.begin_turn(list(command.prompt_ids), command.params.turn_options(request))
        except Exception as exc:
            if request is not None:
                request.close()
            kind = (
                JobError.INVALID
                if isinstance(exc, PagedGenError | ValueError | TypeError)
                else JobError.INTERNAL
            )
            _deliver(command.sink, JobUpdate(error=kind, message=str(exc)))
            return
        job = _Job(
            command.job_id, request, turn_id, command.sink, command.arrived_at, len(command.prompt_ids)
        )
        self._jobs[job.job_id] = job
        self._by_request[id(request)] = job
        if self._metrics is not None:
            self._metrics.on_started(job.prompt_tokens)
        _deliver(job.sink, JobUpdate(started=True))

    def _cancel(self, job_id: int) -> None:
        job = self._jobs.get(job_id)
        if job is None or self._error is not None:
            return
        job.request.cancel_turn(job.turn_id)
        self._forget(job)
        if self._metrics is not None:
            self._metrics.on_cancelled()

    def _forget(self, job: _Job) -> None:
        """Close the job's request (purging its undrained events, freeing its blocks) and drop it."""
        del self._jobs[job.job_id]
        del self._by_request[id(job.request)]
        job.request.close()

    def _step(self) -> None:
        try:
            events = self._engine.run(self._buffer)
        except Exception as exc:
            self._fail(exc)
            return
        now = time.monotonic()
        updates: dict[int, JobUpdate] = {}
        fatal = None
        for event in events:
            if is_engine_failure(event.error_code):
                fatal = f"engine failure ({event.error_code.value})"
            if event.request is None:
                continue
            job = self._by_request.get(id(event.request))
            if job is None:
                continue
            update = updates.get(job.job_id)
            if update is None:
                update = updates[job.job_id] = JobUpdate()
            _copy_event(event, update)
        for job_id, update in updates.items():
            self._deliver_update(self._jobs[job_id], update, now)
        if fatal is not None:
            self._fail(RuntimeError(fatal))

    def _deliver_update(self, job: _Job, update: JobUpdate, now: float) -> None:
        if update.tokens:
            if job.first_token_at is None:
                job.first_token_at = now
                if self._metrics is not None:
                    self._metrics.on_first_token(now - job.arrived_at)
            job.num_tokens += len(update.tokens)
            if self._metrics is not None:
                self._metrics.on_tokens(len(update.tokens))
        if update.finish is not None:
            self._forget(job)
            if self._metrics is not None:
                self._metrics.on_finished(
                    update.finish.reason, job.arrived_at, job.first_token_at, job.num_tokens, now
                )
        _deliver(job.sink, update)

    def _fail(self, exc: BaseException) -> None:
        """Mark the engine unhealthy and end every job in flight with UNAVAILABLE."""
        if self._error is None:
            log.error("engine became unhealthy: %r", exc)
            self._error = f"the engine is unhealthy: {exc}"
        for job in list(self._jobs.values()):
            _deliver(job.sink, JobUpdate(error=JobError.UNAVAILABLE, message=self._error))
            with contextlib.suppress(
                Exception
            ):  # close is allowed on an unhealthy engine; nothing to protect
                job.request.close()
        self._jobs.clear()
        self._by_request.clear()

    def _publish(self) -> None:
        if self._error is not None:
            self._snapshot = EngineSnapshot(
                total_blocks=self._snapshot.total_blocks,
                free_blocks=self._snapshot.free_blocks,
                steps=self._snapshot.steps,
                rollbacks=self._snapshot.rollbacks,
            )
            return
        stats = self._engine.stats()
        self._snapshot = EngineSnapshot(
            total_blocks=stats.total_blocks,
            free_blocks=stats.free_blocks,
            resident_requests=stats.resident_requests,
            queued_requests=stats.queued_requests,
            steps=stats.steps,
            rollbacks=stats.rollbacks,
            jobs=len(self._jobs),
        )

    def _teardown(self) -> None:
        for job in list(self._jobs.values()):
            _deliver(job.sink, JobUpdate(error=JobError.UNAVAILABLE, message="the server is shutting down"))
            if self._error is None:
                self._forget(job)
        self._jobs.clear()
        self._by_request.clear()
        self._error = self._error or "the server is shutting down"
        try:
            self._engine.close()
        except Exception as exc:  # an unhealthy engine may refuse; nothing is left to protect
            log.warning("engine close failed: %r", exc)
        while True:  # refuse what was queued behind the stop command
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Submit):
                _deliver(command.sink, JobUpdate(error=JobError.UNAVAILABLE, message=self._error))
            elif isinstance(command, _Sync):
                command.reply(self._snapshot)


def _options() -> Any:
    from pagedgen.engine.request import RequestOptions

    return RequestOptions()


def _copy_event(event: Any, update: JobUpdate) -> None:
    """Copy one event's payload (the buffer's records are reused by the next run)."""
    if event.flags & EngineEventFlags.TOKEN:
        update.tokens.append(event.token)
        if event.logprobs is not None:
            update.logprobs.append(copy_logprobs(event.token, event.logprobs, len(event.logprobs.top)))
    if event.flags & EngineEventFlags.TURN_FINISHED:
        usage = event.usage
        update.finish = Finish(
            reason=event.finish_reason,
            prompt_tokens=usage.prompt_tokens if usage else 0,
            generated_tokens=usage.generated_tokens if usage else 0,
            cached_prompt_tokens=usage.cached_prompt_tokens if usage else 0,
            matched_stop_string_index=event.matched_stop_string_index,
            error_code=event.error_code,
            text_before_stop=event.text_before_stop,
        )


def _deliver(sink: Sink, update: JobUpdate) -> None:
    try:
        sink(update)
    except RuntimeError as exc:  # the receiving event loop is closed: the client is gone
        log.debug("dropped an update for a closed event loop: %r", exc)


# ---------------------------------------------------------------- asyncio side


class JobHandle:
    """The asyncio end of one job: ``await next()`` yields updates in order; ``cancel()`` is idempotent."""

    def __init__(self, worker: EngineWorker, updates: asyncio.Queue[JobUpdate]):
        self._worker = worker
        self._updates = updates
        self.job_id = 0
        self.done = False

    async def next(self) -> JobUpdate:
        update = await self._updates.get()
        if update.final:
            self.done = True
        return update

    def cancel(self) -> None:
        if not self.done:
            self.done = True
            self._worker.cancel(self.job_id)


class AsyncEngineClient:
    """Bridges asyncio handlers to the worker; must be used from the event loop that serves requests."""

    def __init__(self, worker: EngineWorker):
        self.worker = worker

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, arrived_at: float) -> JobHandle:
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[JobUpdate] = asyncio.Queue()
        handle = JobHandle(self.worker, updates)
        handle.job_id = self.worker.submit(
            prompt_ids, params, lambda u: loop.call_soon_threadsafe(updates.put_nowait, u), arrived_at
        )
        return handle

    async def sync(self) -> EngineSnapshot:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[EngineSnapshot] = loop.create_future()

        def reply(snapshot: EngineSnapshot) -> None:
            loop.call_soon_threadsafe(_resolve, future, snapshot)

        self.worker.sync(reply)
        return await future


def _resolve(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)
