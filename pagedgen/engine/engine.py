"""The Engine: owner thread, request registry, drain-or-execute ``run()``, fatal containment, statistics.

The engine has no worker thread. One owner thread (its creator) performs every Engine and Request call; other
threads must marshal work to it. ``run(buffer)`` is strictly drain-or-execute: a positive-capacity call first
reclaims abandoned requests, then either drains retained events (FIFO) or executes at most one step, moving up
to ``capacity`` of its events into the buffer and retaining the rest. Capacity zero does nothing. After a
fatal step the engine emits one TURN_FINISHED|FAILED event per affected turn and every later ``run`` raises
:class:`EngineUnhealthyError`.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from pagedgen.cache.prefix import BlockHashes
from pagedgen.core.decoder import DecoderModel, TextTokenizer
from pagedgen.engine.config import EngineConfig
from pagedgen.engine.consistency import request_violations
from pagedgen.engine.events import EngineEvent, EngineEventBuffer, EngineEventFlags, FinishReason
from pagedgen.engine.outcomes import FATAL_ERROR_CODE, StepOutcome
from pagedgen.engine.parts import EngineParts, build_engine_parts
from pagedgen.engine.request import (
    GeneratorParams,
    Request,
    RequestOptions,
    RequestState,
    RequestStatus,
    TurnOptions,
    TurnSpec,
    new_cursor,
    validate_token_ids,
)
from pagedgen.engine.step import StepResult
from pagedgen.engine.turn_output import finish_turn_now
from pagedgen.errors import (
    DraftsUnsupportedError,
    EngineClosedError,
    EngineError,
    EngineUnhealthyError,
    InvalidArgumentError,
    RequestClosedError,
    RequestStateError,
    WrongThreadError,
)
from pagedgen.sampling import RequestSampler, StopStringMatcher

MAX_TURN_ID = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine's accounting (cheap; safe to poll every step)."""

    total_blocks: int
    free_blocks: int
    resident_requests: int  # requests holding KV-cache blocks (idle turn-complete residents included)
    queued_requests: int  # requests whose turn is queued (ASSIGNED)
    pending_events: int  # events retained for later run() calls
    steps: int  # committed transactions (dynamic) or executed batch steps (static)
    rollbacks: int  # transactions rolled back (RETRYABLE or execution CAPACITY_BLOCKED)
    healthy: bool = True
    window_total_blocks: int = 0  # blocks of the sliding-window ring pool (0 without one)
    window_free_blocks: int = 0  # of those, free (each resident owns one fixed ring)
    fixed_total_slots: int = 0  # fixed conv / recurrent state slots (max_batch_size; 0 without fixed state)
    fixed_free_slots: int = 0  # of those, free (each resident owns one)
    drafts_proposed: int = 0  # draft tokens committed steps verified, over the engine's lifetime
    drafts_accepted: int = 0  # of those, accepted

    @property
    def draft_acceptance_rate(self) -> float:
        """``drafts_accepted / drafts_proposed`` (0.0 before any draft was verified)."""
        return self.drafts_accepted / self.drafts_proposed if self.drafts_proposed else 0.0

    prefix_caching: bool = False  # whether this engine shares cached prefixes (EngineConfig + the model)
    prefix_caching_off: str | None = None  # why not, when the config asked for it and the model cannot
    cached_blocks: int = 0  # unreferenced blocks holding a cached prefix (counted in free_blocks: evictable)
    prefix_blocks: int = 0  # blocks named in the prefix cache, referenced or not
    prefix_queries: int = 0  # committed admissions that looked their prefix up
    prefix_queried_tokens: int = 0  # their sequence tokens
    prefix_hits: int = 0  # admissions that found at least one cached block
    prefix_hit_tokens: int = 0  # tokens served from the prefix cache instead of computed
    preemptions: int = 0  # running requests sent back to the waiting queue (re-prefilled later)
    idle_evictions: int = 0  # turn-complete residents that yielded their place and blocks
    guided_rows_masked: int = 0  # guidance mask rows computed (a row verifying K drafts counts K + 1)
    mask_seconds: float = 0.0  # wall time of the batched llguidance mask calls (on the mask worker)
    mask_wait_seconds: float = 0.0  # wall time sampling waited for masks after the forward pass


class Engine:
    """Continuous batching over a paged KV cache for one model (the public loop: docs/architecture.md)."""

    def __init__(
        self, model: DecoderModel, config: EngineConfig | None = None, parts: EngineParts | None = None
    ):
        """``parts`` defaults to ``build_engine_parts(model, config)``; parts built for another model or
        config are refused (:class:`InvalidArgumentError`)."""
        config = EngineConfig() if config is None else config
        if not isinstance(config, EngineConfig):
            raise InvalidArgumentError(f"config must be an EngineConfig, got {type(config).__name__}")
        if parts is None:
            parts = build_engine_parts(model, config)
        elif not isinstance(parts, EngineParts) or parts.model is not model or parts.config != config:
            raise InvalidArgumentError("parts must come from build_engine_parts for this model and config")
        self.model = model
        self.config = config
        self._parts = parts
        self._layout = parts.layout
        self._scheduler = parts.scheduler
        self._step = parts.step
        self.num_blocks = parts.num_blocks
        self.eos_token_ids: tuple[int, ...] = tuple(model.eos_token_ids)
        self._owner = threading.get_ident()
        self._abandoned: deque[int] = deque()  # request ids queued by finalizers (any thread)
        self._states: dict[int, RequestState] = {}
        self._pending: deque[EngineEvent] = deque()
        self._next_request_id = 1
        self._fatal: BaseException | None = None
        self._closed = False
        self._steps = 0
        self._rollbacks = 0
        self._drafts_proposed = 0
        self._drafts_accepted = 0
        self._tokenizer: TextTokenizer | None = None

    @property
    def parts(self) -> EngineParts:
        """The collaborators this engine runs on (read-only: an engine's parts never change)."""
        return self._parts

    # -- requests -------------------------------------------------------------------------------------

    def create_request(self, params: GeneratorParams, options: RequestOptions | None = None) -> Request:
        """A new UNASSIGNED request bound to this engine; ``params`` and ``options`` are snapshotted."""
        self._check_usable()
        if not isinstance(params, GeneratorParams) or params.model is not self.model:
            raise InvalidArgumentError("params must be GeneratorParams created for this engine's model")
        if options is not None and not isinstance(options, RequestOptions):
            raise InvalidArgumentError(
                f"options must be RequestOptions or None, got {type(options).__name__}"
            )
        session = 0 if options is None else options.max_session_tokens
        if session > params.max_length:
            raise InvalidArgumentError(f"max_session_tokens {session} exceeds max_length {params.max_length}")
        request_id = self._next_request_id
        sampler = RequestSampler(params.sampling)
        eos = frozenset() if params.sampling.ignore_eos else frozenset(self.eos_token_ids)

        def make_state(handle_ref) -> RequestState:
            return RequestState(
                request_id,
                handle_ref,
                sampler,
                session or params.max_length,
                eos,
                guidance=params.guidance,  # immutable: later set_guidance calls do not leak
            )

        request = Request(self, make_state)
        if self._layout.prefix_caching:
            state = request._state
            state.block_hashes = BlockHashes(state.tokens, self.config.block_size)
        self._next_request_id += 1
        self._states[request_id] = request._state
        return request

    def _begin_turn(
        self, request: Request, token_ids: Sequence[int], turn_options: TurnOptions | None
    ) -> int:
        state = self._checked_state(request)
        self._raise_if_unhealthy()
        if state.status.executable:
            raise RequestStateError(
                f"turn {state.turn_id} of request {state.request_id} is still {state.status.value}"
            )
        if state.num_pending_events:
            raise RequestStateError(
                f"request {state.request_id} has {state.num_pending_events} undrained events; drain them"
            )
        spec = self._turn_spec(request, turn_options)
        tokens = validate_token_ids(token_ids, int(self.model.vocab_size))
        state.check_turn_input(len(tokens))
        if state.turn_id >= MAX_TURN_ID:
            raise RequestStateError(f"request {state.request_id} has used every turn id")
        if state.processed_len and not self._scheduler.is_resident(state):
            raise RequestStateError(
                f"request {state.request_id} lost its cache state (its static batch was recycled); "
                "close it and create a new request"
            )
        cursor = new_cursor(self.model, spec.guidance if spec.guidance_set else state.guidance)
        matcher = StopStringMatcher(spec.stop_strings, self._decode) if spec.stop_strings else None
        turn_id = state.start_turn(tokens, spec, matcher, cursor)
        self._scheduler.submit(state)
        return turn_id

    def _cancel_turn(self, request: Request, turn_id: int) -> bool:
        state = self._checked_state(request)
        if state.turn_id == 0:
            raise RequestStateError(
                f"request {state.request_id} has no turn to cancel: begin_turn was never called"
            )
        if turn_id != state.turn_id or not state.status.executable:
            return False
        if not self._scheduler.is_resident(state):
            self._scheduler.withdraw(state)
        self._enqueue(finish_turn_now(state, FinishReason.CANCELLED))
        return True

    def _set_draft_tokens(self, request: Request, draft_tokens: Sequence[int]) -> None:
        """Validate a proposal completely, then replace the request's pending drafts (nothing else)."""
        state = self._checked_state(request)
        state.draft_tokens = self._validated_drafts(state, draft_tokens)

    def _validated_drafts(self, state: RequestState, draft_tokens: Sequence[int]) -> tuple[int, ...]:
        """The proposal as a tuple of ids; raises, changing nothing, for a string or non-iterable, an engine
        that cannot verify drafts, a request that is not decode-ready, too many ids or ids outside the
        vocabulary. An empty proposal (a clear) is always valid."""
        if isinstance(draft_tokens, (str, bytes)):
            raise InvalidArgumentError("draft_tokens must be a sequence of ints, got a string")
        try:
            draft_tokens = list(draft_tokens)
        except TypeError as exc:
            raise InvalidArgumentError(f"draft_tokens must be a sequence of ints: {exc}") from exc
        if not draft_tokens:
            return ()
        limit = self.max_draft_tokens_per_proposal()
        if limit == 0:
            raise DraftsUnsupportedError(
                "this engine cannot verify draft tokens (max_draft_tokens_per_proposal() is 0: "
                f"{self._no_drafts_reason()}); only an empty list is accepted"
            )
        if not state.ready_for_drafts:
            raise RequestStateError(
                f"request {state.request_id} cannot take drafts while {state.status.value}"
                f"{' (still prefilling)' if state.status is RequestStatus.ACTIVE else ''}: drafts are "
                "verified by a decode, so propose them once the turn emitted a token and is still active"
            )
        if len(draft_tokens) > limit:
            raise InvalidArgumentError(
                f"{len(draft_tokens)} draft tokens exceed max_draft_tokens_per_proposal() = {limit}",
                "draft_tokens",
            )
        return tuple(validate_token_ids(draft_tokens, int(self.model.vocab_size)))

    def _close_request(self, request: Request) -> None:
        self._check_owner()
        state = request._state
        if state.status is RequestStatus.CLOSED:
            return
        request._finalizer.detach()
        self._release(state)

    def max_draft_tokens_per_proposal(self) -> int:
        """The most draft tokens one proposal may carry (``EngineConfig.max_draft_tokens``), or 0 when this
        engine cannot verify drafts: static batching, or fixed conv / recurrent state, which would have to
        be replayed to an accepted prefix. A per-request query limit (``chunk_size``, the sliding-window
        rings' C) caps it to that limit minus the mandatory token. It is a capability, not a promise that
        every draft fits the next step's token budget or free blocks: the scheduler cuts what does not."""
        self._check_owner()
        if self._no_drafts_reason():
            return 0
        return self._draft_limit()

    def _draft_limit(self) -> int:
        """``max_draft_tokens`` within the per-request query limits (the decode token takes one)."""
        limit = min(self.config.max_draft_tokens, self.config.max_scheduled_tokens - 1)
        chunk = self._scheduler.chunk_size
        return limit if chunk is None else min(limit, chunk - 1)

    def _no_drafts_reason(self) -> str:
        """Why drafts cannot be verified here ('' when they can)."""
        if not self.config.dynamic_batching:
            return "static batching does not verify drafts"
        cache = self._parts.cache
        if cache is not None and cache.fixed is not None:
            return "the model keeps fixed conv / recurrent state, which cannot commit an accepted prefix"
        if self.config.max_draft_tokens == 0:
            return "EngineConfig.max_draft_tokens is 0"
        if self._draft_limit() == 0:
            return "max_scheduled_tokens or chunk_size leaves no room beside the decode token"
        return ""

    # -- progress -------------------------------------------------------------------------------------

    def create_event_buffer(self, capacity: int) -> EngineEventBuffer:
        self._check_owner()
        return EngineEventBuffer(self, capacity)

    def run(
        self, buffer: EngineEventBuffer | None = None, *, max_events: int | None = None
    ) -> EngineEventBuffer:
        """Drain retained events or execute at most one step; returns ``buffer`` filled with events.

        Raises :class:`EngineUnhealthyError` once a fatal failure's events have all been drained.
        """
        self._check_usable()
        buffer = self._resolve_buffer(buffer, max_events)
        buffer._reset()
        if buffer.capacity == 0:
            self._raise_if_unhealthy()
            return buffer
        self._reclaim_abandoned()
        if not self._pending:
            self._raise_if_unhealthy()
            self._apply(self._step.run())
        self._drain(buffer)
        return buffer

    def has_pending_requests(self) -> bool:
        """True while retained events or schedulable work exist (reclaims abandoned requests first)."""
        self._check_usable()
        self._reclaim_abandoned()
        return bool(self._pending) or self._scheduler.has_work()

    def stats(self) -> EngineStats:
        self._check_owner()
        total, free = self._scheduler.block_counts()
        window_total, window_free = self._scheduler.window_block_counts()
        fixed_total, fixed_free = self._scheduler.fixed_slot_counts()
        cache = self._parts.cache
        cache_stats = None if cache is None else cache.stats()
        prefix = None if cache_stats is None else cache_stats.prefix
        masks = self._step.masker.stats
        return EngineStats(
            total_blocks=total,
            free_blocks=free,
            resident_requests=self._scheduler.num_resident,
            queued_requests=sum(s.status is RequestStatus.ASSIGNED for s in self._states.values()),
            pending_events=len(self._pending),
            steps=self._steps,
            rollbacks=self._rollbacks,
            healthy=self._fatal is None,
            window_total_blocks=window_total,
            window_free_blocks=window_free,
            fixed_total_slots=fixed_total,
            fixed_free_slots=fixed_free,
            drafts_proposed=self._drafts_proposed,
            drafts_accepted=self._drafts_accepted,
            prefix_caching=self._layout.prefix_caching,
            prefix_caching_off=self._layout.prefix_off,
            cached_blocks=0 if cache_stats is None else cache_stats.cached_blocks,
            prefix_blocks=0 if cache_stats is None else cache_stats.prefix_blocks,
            prefix_queries=0 if prefix is None else prefix.queries,
            prefix_queried_tokens=0 if prefix is None else prefix.queried_tokens,
            prefix_hits=0 if prefix is None else prefix.hits,
            prefix_hit_tokens=0 if prefix is None else prefix.hit_tokens,
            preemptions=self._scheduler.num_preemptions,
            idle_evictions=self._scheduler.num_yields,
            guided_rows_masked=masks.rows_masked,
            mask_seconds=masks.mask_seconds,
            mask_wait_seconds=masks.wait_seconds,
        )

    def snapshot(self) -> dict[str, object]:
        """Everything committed about the requests, the retained events and the parts, as comparable values
        (each part's own ``snapshot()``): a rolled-back step or a refused call leaves it equal. Mutates
        nothing; meant for tests and diagnostics, not for polling (``stats()`` is the cheap view)."""
        self._check_owner()
        return {
            "requests": {rid: state.snapshot() for rid, state in self._states.items()},
            "pending": [event.snapshot() for event in self._pending],
            **self._scheduler.snapshot(),
        }

    def check_invariants(self) -> list[str]:
        """Every cache and request accounting violation (empty when consistent). Mutates nothing."""
        self._check_owner()
        return request_violations(self._states, self._scheduler, self._pending)

    def close(self) -> None:
        """Close every request (releasing all cache blocks) and refuse further work. Idempotent."""
        self._check_owner()
        if self._closed:
            return
        for state in list(self._states.values()):
            handle = state.handle
            if handle is not None:
                handle._finalizer.detach()
            self._release(state)
        self._abandoned.clear()
        self._pending.clear()
        self._step.masker.close()
        self._parts.runner.release()
        self._closed = True

    # -- internals ------------------------------------------------------------------------------------

    def _apply(self, result: StepResult) -> None:
        """Account for a step's outcome and retain its events (the engine side of the step's outcome)."""
        if result.outcome.is_fatal:
            self._become_unhealthy(result)
            return
        if result.outcome is StepOutcome.COMMITTED:
            self._steps += 1
            self._drafts_proposed += result.drafts_proposed
            self._drafts_accepted += result.drafts_accepted
        elif result.outcome.rolled_back:
            self._rollbacks += 1
        self._enqueue(result.events)
        if self.config.debug_invariants:
            problems = self.check_invariants()
            if problems:
                raise EngineError("engine invariants violated after a step:\n  " + "\n  ".join(problems))

    def _become_unhealthy(self, result: StepResult) -> None:
        """Store the failure and finish every affected turn FAILED (or emit one request-less FAILED event)."""
        self._fatal = result.error
        code = FATAL_ERROR_CODE[result.outcome]
        affected = list(result.affected) + [s for s in self._states.values() if s.status.executable]
        events: list[EngineEvent] = []
        for state in dict.fromkeys(affected):
            if state.status is RequestStatus.CLOSED:
                continue
            self._scheduler.withdraw(state)
            events += finish_turn_now(state, FinishReason.FAILED, code)
        if not events:
            events.append(EngineEvent.engine_level(EngineEventFlags.FAILED, code))
        self._enqueue(events)

    def _enqueue(self, events: list[EngineEvent]) -> None:
        for event in events:
            if event.request_id is not None:
                self._states[event.request_id].num_pending_events += 1
        self._pending.extend(events)

    def _drain(self, buffer: EngineEventBuffer) -> None:
        count = min(buffer.capacity, len(self._pending))
        events = [self._pending.popleft() for _ in range(count)]
        for event in events:
            if event.request_id is not None:
                self._states[event.request_id].num_pending_events -= 1
        buffer._fill(events)

    def _release(self, state: RequestState) -> None:
        """Logical and physical removal: scheduler, cache blocks, pending events, registry. Final."""
        self._scheduler.release(state)
        if state.num_pending_events:
            self._pending = deque(e for e in self._pending if e.request_id != state.request_id)
            state.num_pending_events = 0
        state.status = RequestStatus.CLOSED
        state.stop_matcher = None
        state.cursor = None
        state.held_logprobs = []
        del self._states[state.request_id]

    def _reclaim_abandoned(self) -> None:
        while self._abandoned:
            state = self._states.get(self._abandoned.popleft())
            if state is not None:
                self._release(state)

    def _resolve_buffer(self, buffer: EngineEventBuffer | None, max_events: int | None) -> EngineEventBuffer:
        if buffer is None:
            if max_events is None:
                raise InvalidArgumentError("run() needs an event buffer or max_events")
            return EngineEventBuffer(self, max_events)
        if max_events is not None:
            raise InvalidArgumentError("pass either an event buffer or max_events to run(), not both")
        if not isinstance(buffer, EngineEventBuffer) or not buffer.bound_to(self):
            raise InvalidArgumentError("the event buffer was not created by this engine")
        return buffer

    def _turn_spec(self, request: Request, turn_options: TurnOptions | None) -> TurnSpec:
        if turn_options is None:
            return TurnSpec()
        if not isinstance(turn_options, TurnOptions):
            raise InvalidArgumentError(
                f"turn_options must be TurnOptions or None, got {type(turn_options).__name__}"
            )
        if turn_options.request is not None and turn_options.request is not request:
            raise InvalidArgumentError("these TurnOptions were created for a different request")
        return turn_options.spec

    def _decode(self, token_ids: list[int]) -> str:
        if self._tokenizer is None:
            self._tokenizer = self.model.tokenizer
        return self._tokenizer.decode(token_ids)

    def _checked_state(self, request: Request) -> RequestState:
        self._check_owner()
        state = request._state
        if state.status is RequestStatus.CLOSED:
            raise RequestClosedError(f"request {state.request_id} is closed")
        return state

    def _check_owner(self) -> None:
        if threading.get_ident() != self._owner:
            raise WrongThreadError(
                "Engine and Request calls must come from the engine's owner thread (its creator); "
                "marshal the call to that thread"
            )

    def _check_usable(self) -> None:
        self._check_owner()
        if self._closed:
            raise EngineClosedError("the engine is closed")

    def _raise_if_unhealthy(self) -> None:
        if self._fatal is not None:
            raise EngineUnhealthyError(
                f"the engine is unhealthy after a fatal step failure: {self._fatal!r}", self._fatal
            ) from self._fatal

    def __repr__(self) -> str:
        mode = "dynamic" if self.config.dynamic_batching else "static"
        healthy = self._fatal is None
        return f"Engine({mode}, requests={len(self._states)}, blocks={self.num_blocks}, healthy={healthy})"
