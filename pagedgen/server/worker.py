"""The engine's owner thread: every Engine and Request call of the server happens here.

The engine is single-owner, so HTTP handlers never touch it: they put immutable commands (submit, cancel,
sync) on a thread-safe queue, and this thread applies them, runs one engine transaction at a time and hands
each job its :class:`JobUpdate`; :class:`AsyncEngineClient` is the asyncio side. A failed engine run makes
the server unhealthy for good (every job gets ``UNAVAILABLE``), a failed command fails only its job, and a
shutdown whose timeout ran out aborts the jobs in flight (``SHUTDOWN``). After commands and after every step
the worker publishes an immutable :class:`EngineSnapshot` that ``/metrics`` and ``/health`` read without
waiting. The whole design: docs/server.md, "How it works" and "Shutdown and connection limits".
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
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

from pagedgen.engine.events import EngineErrorCode, EngineEventFlags, FinishReason
from pagedgen.errors import EngineClosedError, EngineUnhealthyError, PagedGenError
from pagedgen.llm import copy_logprobs, generator_params, is_engine_failure, turn_options
from pagedgen.sampling.logprobs import TokenLogprob
from pagedgen.sampling.options import SamplingOptions
from pagedgen.sampling.params import SamplingParams

if TYPE_CHECKING:
    from pagedgen.engine.config import EngineConfig
    from pagedgen.engine.engine import Engine
    from pagedgen.engine.events import EngineEvent, EngineEventBuffer
    from pagedgen.engine.request import Request, RequestOptions
    from pagedgen.llm import ServedModel
    from pagedgen.server.metrics import ServerMetrics
    from pagedgen.server.worker_protocol import ServingWorker  # it imports this module's records
    from pagedgen.spec import DraftDriver

log = logging.getLogger("pagedgen.server")

# What a refused or ended request is told (the guard answers its up-front 503s with the same two texts).
SHUTDOWN_MESSAGE = "the server is shutting down"
UNAVAILABLE_MESSAGE = "the engine is unhealthy; the server cannot serve requests"  # the cause is only logged


class JobError(enum.Enum):
    """Why a job ended without a normal finish; the route maps each to an HTTP status."""

    INVALID = "invalid"  # the engine refused the parameters or the prompt (400)
    UNAVAILABLE = "unhealthy"  # the engine is unhealthy (503)
    SHUTDOWN = "shutting_down"  # the server is shutting down: the job was ended or refused by the drain (503)
    INTERNAL = "internal"  # an unexpected error while submitting (500; the detail is only logged)


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
    error_message: str = ""  # with a failed turn: why, when the engine says (llguidance's reason)
    reused_tokens: int = 0  # positions before the turn's input it did not compute (a kept Request's history)


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
    """A copy of the engine's counters, published by the owner thread (replaced whole, never mutated)."""

    total_blocks: int = 0
    free_blocks: int = 0
    resident_requests: int = 0
    queued_requests: int = 0
    steps: int = 0
    rollbacks: int = 0
    jobs: int = 0
    healthy: bool = True
    window_total_blocks: int = 0  # the sliding-window ring pool (0 without one)
    window_free_blocks: int = 0
    fixed_total_slots: int = 0  # fixed conv / recurrent state slots (0 without fixed state)
    fixed_free_slots: int = 0
    drafts_proposed: int = 0  # speculative draft tokens the engine verified
    drafts_accepted: int = 0  # of those, accepted
    prefix_queried_tokens: int = 0  # prompt tokens of committed admissions that looked up the prefix cache
    prefix_hit_tokens: int = 0  # of those, served from the cache
    preemptions: int = 0
    kept_requests: int = 0  # finished turns whose Request stays open for a follow-up (see Keep)
    resumed_turns: int = 0  # follow-up turns that continued in a kept Request

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.free_blocks


# The snapshot's fields copied from ``engine.stats()`` under the same name (all but the worker's own).
_WORKER_COUNTS = ("jobs", "healthy", "kept_requests", "resumed_turns")
_ENGINE_COUNTS = tuple(f.name for f in fields(EngineSnapshot) if f.name not in _WORKER_COUNTS)
# Kept Requests beyond this many are closed, least recently kept first (their blocks go to the prefix
# cache): the server's response store releases the ones it evicts, this bounds the ones nobody stored.
MAX_KEPT_REQUESTS = 64


@dataclass(frozen=True, slots=True)
class Keep:
    """A job's multi-turn options: ``keep_as`` keeps its Request open after the turn ends (under that key,
    until :meth:`EngineWorker.release` or the ``MAX_KEPT_REQUESTS`` bound closes it); ``resume`` names a
    kept Request to continue in.

    A resumed job's ``prompt_ids`` are still the whole conversation: the worker continues in the kept
    Request with only the ids past the tokens it holds when they are a prefix of the conversation and
    the sampling options are the same, and otherwise closes it and starts a fresh Request with the whole
    conversation (whose admission then finds what the closed one held in the prefix cache).
    """

    keep_as: str | None = None
    resume: str | None = None


@dataclass(slots=True)
class _Kept:
    request: Request
    sampling: SamplingOptions  # a resumed job must sample the same way


Sink = Callable[[JobUpdate], None]


@dataclass(frozen=True, slots=True)
class _Submit:
    job_id: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    sink: Sink
    arrived_at: float
    tag: str  # the HTTP request id, for log lines
    keep: Keep | None = None


@dataclass(frozen=True, slots=True)
class _Cancel:
    job_id: int


@dataclass(frozen=True, slots=True)
class _Release:
    key: str


@dataclass(frozen=True, slots=True)
class _Sync:
    reply: Callable[[EngineSnapshot], None]


@dataclass(frozen=True, slots=True)
class _Abort:
    pass


@dataclass(frozen=True, slots=True)
class _Stop:
    pass


_Command = _Submit | _Cancel | _Release | _Sync | _Abort | _Stop


@dataclass(slots=True)
class _Job:
    """Owner-thread bookkeeping of one in-flight turn."""

    job_id: int
    request: Request
    turn_id: int
    sink: Sink
    arrived_at: float
    prompt_tokens: int
    first_token_at: float | None = None
    num_tokens: int = 0
    tag: str = ""  # the HTTP request id, for log lines
    keep_as: str | None = None
    sampling: SamplingOptions | None = None  # with keep_as: the options a resumed job must match


class EngineWorker:
    """Owns one Engine on a dedicated thread and serves submit / cancel / sync commands from any thread.

    ``metrics`` (optional) receives ``on_started / on_tokens / on_finished / on_cancelled`` calls from the
    owner thread. ``start`` creates the engine on the new thread and re-raises its construction error.
    ``speculative="ngram"`` proposes up to ``num_speculative_tokens`` prompt-lookup drafts for every
    decoding job before each step (:mod:`pagedgen.spec`); ``start`` raises ``ValueError`` for a bad setting.
    """

    def __init__(
        self,
        model: ServedModel,
        engine_config: EngineConfig,
        *,
        metrics: ServerMetrics | None = None,
        max_events: int = 256,
        speculative: str | None = None,
        num_speculative_tokens: int = 4,
    ):
        self._model = model
        self._config = engine_config
        self._speculative = speculative
        self._num_speculative_tokens = num_speculative_tokens
        self._drafter: DraftDriver | None = None
        self._metrics = metrics
        self._max_events = max_events
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._ids = itertools.count(1)
        self._jobs: dict[int, _Job] = {}  # owner thread only
        self._by_request: dict[int, _Job] = {}  # id(request) -> job; owner thread only
        self._kept: OrderedDict[str, _Kept] = OrderedDict()  # owner thread only; least recently kept first
        self._resumed_turns = 0
        self._engine: Engine | None = None  # created on the owner thread by start()
        self._buffer: EngineEventBuffer | None = None
        self._snapshot = EngineSnapshot()
        self._error: str | None = None
        self._aborted = False  # owner thread only: set by abort(), later submissions are refused
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
        """Why the engine is unhealthy (for the operator: it may hold an exception's text), or None."""
        return self._error

    @property
    def snapshot(self) -> EngineSnapshot:
        """The latest published counters (a plain read: never waits for the owner thread)."""
        return self._snapshot

    @property
    def model(self) -> ServedModel:
        """The served model (read-only: parameters are checked against it off the owner thread)."""
        return self._model

    @property
    def max_batch_size(self) -> int:
        return int(getattr(self._config, "max_batch_size", 1))

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        sink: Sink,
        arrived_at: float,
        tag: str = "",
        keep: Keep | None = None,
    ) -> int:
        """Queue a one-turn job; its updates go to ``sink`` (called on the owner thread). Returns its id.
        ``keep``: keep its Request open afterwards, or continue in a kept one (see :class:`Keep`)."""
        job_id = next(self._ids)
        self._commands.put(_Submit(job_id, tuple(prompt_ids), params, sink, arrived_at, tag, keep))
        return job_id

    def release(self, key: str) -> None:
        """Close the Request kept under ``key`` (its blocks go to the prefix cache); no-op if none is."""
        self._commands.put(_Release(key))

    def cancel(self, job_id: int) -> None:
        """Cancel the job's turn and close its request (its blocks return to the pool); no-op if finished."""
        self._commands.put(_Cancel(job_id))

    def sync(self, reply: Callable[[EngineSnapshot], None]) -> None:
        """Call ``reply(snapshot)`` once every command queued before this one has been applied."""
        self._commands.put(_Sync(reply))

    def abort(self) -> None:
        """End every job in flight with ``SHUTDOWN`` (their requests closed, blocks freed) and refuse every
        later submission the same way: the last step of a drain whose timeout ran out. The engine stays
        healthy, so ``/metrics`` still reads its counters."""
        self._commands.put(_Abort())

    def shutdown(self) -> None:
        """Stop the owner thread: close every request and the engine, refuse jobs still in flight."""
        if self._thread.is_alive():
            self._commands.put(_Stop())
            self._thread.join()

    # ------------------------------------------------------------ owner thread

    def _main(self) -> None:
        try:
            from pagedgen.engine.engine import Engine
            from pagedgen.spec import make_driver

            self._engine = Engine(self._model, self._config)
            self._drafter = make_driver(self._engine, self._speculative, self._num_speculative_tokens)
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
        """One loop turn: apply commands, publish counters, run one transaction if there is work."""
        try:
            if not self._take_commands(block=not self._has_work()):
                return False
            self._publish()
            if self._has_work():
                self._step()
        except Exception as exc:  # an engine-level error: clients must not be left waiting forever
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

    def _apply(self, command: _Command) -> None:
        """Apply one command; its error fails at most its own job, unless the engine says it is unhealthy."""
        try:
            if isinstance(command, _Submit):
                self._submit(command)
            elif isinstance(command, _Cancel):
                self._cancel(command.job_id)
            elif isinstance(command, _Release):
                self._close_kept(command.key)
            elif isinstance(command, _Abort):
                self._abort()
            elif isinstance(command, _Sync):
                self._publish()
                command.reply(self._snapshot)
        except (EngineUnhealthyError, EngineClosedError) as exc:
            self._fail(exc)
        except Exception:
            log.exception("command %s failed; the engine stays healthy", type(command).__name__)

    def _submit(self, command: _Submit) -> None:
        if self._error is not None:
            _deliver(command.sink, JobUpdate(error=JobError.UNAVAILABLE, message=UNAVAILABLE_MESSAGE))
            return
        if self._aborted:
            _deliver(command.sink, JobUpdate(error=JobError.SHUTDOWN, message=SHUTDOWN_MESSAGE))
            return
        try:
            request, turn_id = self._begin(command)
        except Exception as exc:
            _deliver(command.sink, _refusal(exc, command.tag))
            if isinstance(exc, EngineUnhealthyError | EngineClosedError):
                raise
            return
        job = _Job(
            command.job_id, request, turn_id, command.sink, command.arrived_at, len(command.prompt_ids)
        )
        job.tag = command.tag
        if command.keep is not None and command.keep.keep_as is not None:
            job.keep_as = command.keep.keep_as
            job.sampling = command.params.sampling_options()
        self._jobs[job.job_id] = job
        self._by_request[id(request)] = job
        if self._metrics is not None:
            self._metrics.on_started(job.prompt_tokens)
        _deliver(job.sink, JobUpdate(started=True))

    def _begin(self, command: _Submit) -> tuple[Request, int]:
        """The job's Request (a kept one it resumes, or a fresh one) and its started turn."""
        params, ids = command.params, list(command.prompt_ids)
        kept = self._take_kept(command)
        if kept is not None:
            held = len(kept.request.tokens)
            options = turn_options(kept.request, params)
            if params.structured_outputs is None:  # the kept Request's params may carry a constraint
                options.set_guidance(None)
            try:
                turn_id = kept.request.begin_turn(ids[held:], options)
            except Exception:
                kept.request.close()
                raise
            self._resumed_turns += 1
            return kept.request, turn_id
        request = self._engine.create_request(generator_params(self._model, params), _options())
        try:
            return request, request.begin_turn(ids, turn_options(request, params))
        except Exception:
            with contextlib.suppress(Exception):  # a refused begin_turn left the request unassigned
                request.close()
            raise

    def _take_kept(self, command: _Submit) -> _Kept | None:
        """The kept Request the job resumes when it can continue there (see :class:`Keep`), else None
        (a kept Request that cannot serve it is closed)."""
        key = None if command.keep is None else command.keep.resume
        kept = None if key is None else self._kept.pop(key, None)
        if kept is None:
            return None
        held = kept.request.tokens
        ids = command.prompt_ids
        fits = len(ids) > len(held) and ids[: len(held)] == tuple(held)
        if fits and kept.sampling == command.params.sampling_options():
            return kept
        kept.request.close()
        return None

    def _close_kept(self, key: str) -> None:
        kept = self._kept.pop(key, None)
        if kept is not None:
            kept.request.close()

    def _cancel(self, job_id: int) -> None:
        job = self._jobs.get(job_id)
        if job is None or self._error is not None:
            return
        try:
            job.request.cancel_turn(job.turn_id)
        finally:
            self._forget(job)  # closing frees the blocks even if cancel_turn refused
        if self._metrics is not None:
            self._metrics.on_cancelled()

    def _abort(self) -> None:
        self._aborted = True
        if self._error is not None:
            return  # _fail already ended every job
        for job in list(self._jobs.values()):
            _deliver(job.sink, JobUpdate(error=JobError.SHUTDOWN, message=SHUTDOWN_MESSAGE))
            self._forget(job)
            if self._metrics is not None:
                self._metrics.on_cancelled()
        self._publish()

    def _forget(self, job: _Job, keep: bool = False) -> None:
        """Close the job's request (purging its undrained events, freeing its blocks) and drop it; with
        ``keep``, the finished request stays open under the job's ``keep_as`` key instead."""
        del self._jobs[job.job_id]
        del self._by_request[id(job.request)]
        if self._drafter is not None:
            self._drafter.forget(job.request)
        if not keep or job.keep_as is None or job.sampling is None:
            job.request.close()
            return
        self._close_kept(job.keep_as)
        self._kept[job.keep_as] = _Kept(job.request, job.sampling)
        while len(self._kept) > MAX_KEPT_REQUESTS:
            _key, oldest = self._kept.popitem(last=False)
            oldest.request.close()

    def _step(self) -> None:
        try:
            if self._drafter is not None:
                self._drafter.propose(job.request for job in self._jobs.values())
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
            if event.error_message:  # a turn that failed alone, with its cause: the client gets it too
                log.warning("request %s: its turn failed: %s", job.tag or "?", event.error_message)
        deliveries = [self._settle(self._jobs[job_id], update, now) for job_id, update in updates.items()]
        self._publish()  # before the updates: a client that has its answer sees it counted
        for sink, update in deliveries:
            _deliver(sink, update)
        if fatal is not None:
            self._fail(RuntimeError(fatal))

    def _settle(self, job: _Job, update: JobUpdate, now: float) -> tuple[Sink, JobUpdate]:
        """Account one job's update (metrics; a finished job is closed); an error fails that job alone."""
        try:
            self._account(job, update, now)
        except Exception:
            log.exception("job %d: settling its update failed; failing that job alone", job.job_id)
            if job.job_id in self._jobs:
                with contextlib.suppress(Exception):
                    self._forget(job)
            return job.sink, JobUpdate(error=JobError.INTERNAL, message="internal error")
        return job.sink, update

    def _account(self, job: _Job, update: JobUpdate, now: float) -> None:
        if update.tokens:
            if job.first_token_at is None:
                job.first_token_at = now
                if self._metrics is not None:
                    self._metrics.on_first_token(now - job.arrived_at)
            job.num_tokens += len(update.tokens)
            if self._metrics is not None:
                self._metrics.on_tokens(len(update.tokens))
        if update.finish is not None:
            self._forget(job, keep=update.finish.reason not in (FinishReason.FAILED, FinishReason.CANCELLED))
            if self._metrics is not None:
                self._metrics.on_finished(
                    update.finish.reason, job.arrived_at, job.first_token_at, job.num_tokens, now
                )

    def _fail(self, exc: BaseException) -> None:
        """Mark the engine unhealthy and end every job in flight with UNAVAILABLE."""
        if self._error is None:
            log.error("engine became unhealthy: %r", exc)
            self._error = f"the engine is unhealthy: {exc}"
        for job in list(self._jobs.values()):
            _deliver(job.sink, JobUpdate(error=JobError.UNAVAILABLE, message=UNAVAILABLE_MESSAGE))
            with contextlib.suppress(
                Exception
            ):  # close is allowed on an unhealthy engine; nothing to protect
                job.request.close()
        self._jobs.clear()
        self._by_request.clear()
        self._kept.clear()  # the engine is unusable: nothing to close
        self._publish()

    def _publish(self) -> None:
        if self._error is not None:  # the engine may not be asked any more: keep its last counts
            self._snapshot = replace(
                self._snapshot, resident_requests=0, queued_requests=0, jobs=0, healthy=False
            )
            return
        stats = self._engine.stats()
        counts = {name: getattr(stats, name) for name in _ENGINE_COUNTS}
        self._snapshot = EngineSnapshot(
            jobs=len(self._jobs), kept_requests=len(self._kept), resumed_turns=self._resumed_turns, **counts
        )

    def _teardown(self) -> None:
        for job in list(self._jobs.values()):
            _deliver(job.sink, JobUpdate(error=JobError.SHUTDOWN, message=SHUTDOWN_MESSAGE))
            if self._error is None:
                self._forget(job)
        self._jobs.clear()
        self._by_request.clear()
        if self._error is None:
            for key in list(self._kept):
                self._close_kept(key)
            self._log_blocks()
        self._error = self._error or SHUTDOWN_MESSAGE
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
                _deliver(command.sink, JobUpdate(error=JobError.SHUTDOWN, message=SHUTDOWN_MESSAGE))
            elif isinstance(command, _Sync):
                command.reply(self._snapshot)

    def _log_blocks(self) -> None:
        """The operator's proof that the shutdown released the KV cache (every request is closed here)."""
        try:
            stats = self._engine.stats()
        except Exception as exc:
            log.warning("engine stats at shutdown failed: %r", exc)
            return
        log.info("engine stopping: %d of %d KV-cache blocks free", stats.free_blocks, stats.total_blocks)


def _options() -> RequestOptions:
    from pagedgen.engine.request import RequestOptions

    return RequestOptions()


def _copy_event(event: EngineEvent, update: JobUpdate) -> None:
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
            error_message=event.error_message,
            reused_tokens=usage.reused_tokens if usage else 0,
        )


def _refusal(exc: Exception, tag: str) -> JobUpdate:
    """The update of a job whose command the engine refused: bad input is 400 with the engine's message."""
    if isinstance(exc, EngineUnhealthyError | EngineClosedError):
        return JobUpdate(error=JobError.UNAVAILABLE, message=UNAVAILABLE_MESSAGE)
    if isinstance(exc, PagedGenError) and isinstance(exc, ValueError):
        return JobUpdate(error=JobError.INVALID, message=str(exc))
    log.error("request %s: starting its turn failed", tag or "?", exc_info=exc)
    return JobUpdate(error=JobError.INTERNAL, message="internal error")


def _deliver(sink: Sink, update: JobUpdate) -> None:
    try:
        sink(update)
    except RuntimeError as exc:  # the receiving event loop is closed: the client is gone
        log.debug("dropped an update for a closed event loop: %r", exc)
    except Exception:  # one client's sink must not stop the owner thread
        log.exception("dropped an update: its sink raised")


# ---------------------------------------------------------------- asyncio side


class JobHandle:
    """The asyncio end of one job: ``await next()`` yields updates in order; ``cancel()`` is idempotent."""

    def __init__(self, worker: ServingWorker, updates: asyncio.Queue[JobUpdate]):
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

    def __init__(self, worker: ServingWorker):
        self.worker = worker

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        arrived_at: float,
        tag: str = "",
        keep: Keep | None = None,
    ) -> JobHandle:
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[JobUpdate] = asyncio.Queue()
        handle = JobHandle(self.worker, updates)
        sink = lambda u: loop.call_soon_threadsafe(updates.put_nowait, u)  # noqa: E731
        handle.job_id = self.worker.submit(prompt_ids, params, sink, arrived_at, tag, keep)
        return handle
