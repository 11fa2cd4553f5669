"""Requests: caller handles, generation parameters, per-turn options, and the engine-owned request state.

The caller holds the :class:`Request` handle and the engine the :class:`RequestState` (the handle holds the
engine, never the reverse), so a dropped handle is noticed by a finalizer that only queues its id and the
engine reclaims the request at its next boundary. The lifecycle and the counters: docs/engine.md,
"Requests, handles and their counters".
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import operator
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedgen.cache.prefix import BlockHashes
from pagedgen.core.decoder import DecoderModel
from pagedgen.engine.events import FinishReason, TokenLogprobs, TurnReuse, Usage
from pagedgen.errors import GuidanceError, InvalidArgumentError, SamplingOptionsError, SessionLimitError
from pagedgen.guidance import GuidanceSpec, compile_guidance
from pagedgen.guidance.cursor import GrammarCursor
from pagedgen.sampling import RequestSampler, SamplingOptions, StopStringMatcher
from pagedgen.sampling.options import (
    check_max_generated_tokens,
    check_num_logprobs,
    check_stop_strings,
)

if TYPE_CHECKING:
    from pagedgen.engine.engine import Engine
    from pagedgen.sampling.params import SamplingParams


class RequestStatus(enum.Enum):
    UNASSIGNED = "unassigned"  # created, no turn yet
    ASSIGNED = "assigned"  # a turn is queued: its input waits for execution
    ACTIVE = "active"  # the turn is executing (prefilled at least once)
    TURN_COMPLETE = "turn_complete"  # the turn ended; a later turn may continue the sequence
    CLOSED = "closed"  # terminal; the engine holds nothing for it

    @property
    def executable(self) -> bool:
        return self is RequestStatus.ASSIGNED or self is RequestStatus.ACTIVE


_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingOptions))


class GeneratorParams:
    """Request-level generation parameters, snapshotted by ``Engine.create_request`` (later edits don't leak).

    ``max_length`` (default: the model's context length, and never above it) is the cumulative sequence limit
    of a request; ``sampling`` is a :class:`pagedgen.sampling.SamplingOptions`. ``GeneratorParams(model,
    params)`` takes a caller's validated :class:`pagedgen.sampling.params.SamplingParams` as it is
    (:meth:`set_sampling_params`); :meth:`set_search_options` sets the same options by name, the ONNX
    Runtime GenAI way.
    """

    def __init__(self, model: Any, params: SamplingParams | None = None):
        self.model = model
        self.max_length: int = int(model.max_context)
        self.sampling = SamplingOptions()
        self.guidance: GuidanceSpec | None = None
        if params is not None:
            self.set_sampling_params(params)

    def set_guidance(self, kind: str | None, data: Any = "") -> None:
        """Constrain every turn's output to a ``"json_schema"``, ``"regex"`` or ``"lark_grammar"``.

        ``kind=None`` clears it. A per-turn ``TurnOptions.set_guidance`` overrides it for one turn. A kind
        that is unknown, or a schema / grammar that does not compile (on its own or against this model's
        tokenizer), is refused here with an :class:`InvalidArgumentError` (``field="guidance"``) and the
        params keep what they had.
        """
        guidance = _compiled_guidance(kind, data)
        new_cursor(self.model, guidance)  # compiles (cached) against the tokenizer, or refuses
        self.guidance = guidance

    def set_sampling_params(self, params: SamplingParams) -> None:
        """Take a validated ``SamplingParams``: its :meth:`~SamplingParams.sampling_options` and its
        structured-outputs constraint (the request's guidance; None clears it). All-or-nothing: what the
        model refuses (a token id outside its vocabulary, a constraint its tokenizer cannot follow) is an
        :class:`InvalidArgumentError` naming the field, and the params keep what they had."""
        sampling = params.sampling_options()
        self._check(sampling, self.max_length)
        constraint = params.structured_outputs
        guidance = None if constraint is None else _compiled_guidance(*constraint.guidance())
        new_cursor(self.model, guidance)
        self.sampling, self.guidance = sampling, guidance

    def set_search_options(self, **options: Any) -> None:
        """Set any of ``max_length`` and the SamplingOptions fields by name; all-or-nothing, unknown names
        raise (the ONNX Runtime GenAI-compatible form of :meth:`set_sampling_params`).

        Every value is checked here, against the model too (token ids inside its vocabulary), so a bad
        option is refused with an :class:`InvalidArgumentError` naming it (``field``) before any request
        can carry it into a step.
        """
        unknown = sorted(set(options) - _SAMPLING_FIELDS - {"max_length"})
        if unknown:
            allowed = ", ".join(sorted(_SAMPLING_FIELDS | {"max_length"}))
            raise InvalidArgumentError(
                f"unknown search option(s) {unknown}; known options: {allowed}", field=unknown[0]
            )
        max_length = options.pop("max_length", self.max_length)
        self._check_max_length(max_length)
        bias = options.get("logit_bias")
        if isinstance(bias, Mapping):  # {token: bias} is the OpenAI shape
            try:
                options["logit_bias"] = tuple(sorted(bias.items()))
            except TypeError as exc:  # keys of mixed types do not sort
                raise InvalidArgumentError(f"logit_bias keys must be token ids: {exc}", "logit_bias") from exc
        try:
            sampling = dataclasses.replace(self.sampling, **options)
        except SamplingOptionsError as exc:
            raise InvalidArgumentError(str(exc), exc.field) from exc
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"invalid search option: {exc}") from exc
        self._check(sampling, max_length)
        self.max_length, self.sampling = max_length, sampling

    def _check_max_length(self, max_length: object) -> None:
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
            raise InvalidArgumentError(f"max_length must be an int >= 2, got {max_length!r}", "max_length")
        if max_length > self.model.max_context:
            raise InvalidArgumentError(
                f"max_length {max_length} exceeds the model's context length {self.model.max_context}",
                "max_length",
            )

    def _check(self, sampling: SamplingOptions, max_length: object) -> None:
        """The checks both setters share, the ones that need the model; nothing is changed here."""
        self._check_max_length(max_length)
        try:
            sampling.check_vocabulary(int(self.model.vocab_size))
        except SamplingOptionsError as exc:
            raise InvalidArgumentError(str(exc), exc.field) from exc


class RequestOptions:
    """Reusable request options; ``max_session_tokens`` 0 means "use the params' max_length"."""

    def __init__(self) -> None:
        self.max_session_tokens = 0

    def set_max_session_tokens(self, max_session_tokens: int) -> None:
        """Cumulative limit on prompt + generated + continuation tokens of the whole request."""
        if (
            isinstance(max_session_tokens, bool)
            or not isinstance(max_session_tokens, int)
            or max_session_tokens < 0
        ):
            raise InvalidArgumentError(f"max_session_tokens must be an int >= 0, got {max_session_tokens!r}")
        self.max_session_tokens = max_session_tokens


@dataclass(frozen=True, slots=True)
class TurnSpec:
    """What ``begin_turn`` snapshots from :class:`TurnOptions`."""

    max_generated_tokens: int = 0  # 0: no per-turn limit
    stop_strings: tuple[str, ...] = ()
    num_logprobs: int = 0
    guidance_set: bool = False  # False: the turn uses the request's params guidance
    guidance: GuidanceSpec | None = None  # with guidance_set: this turn's constraint (None: unconstrained)


class TurnOptions:
    """Reusable per-turn options for one request (or for any request when created without one)."""

    def __init__(self, request: Request | None = None):
        if request is not None and not isinstance(request, Request):
            raise InvalidArgumentError(f"TurnOptions takes a Request or None, got {type(request).__name__}")
        self.request = request
        self._spec = TurnSpec()

    def set_max_generated_tokens(self, max_generated_tokens: int) -> None:
        """Limit on the tokens this turn generates; 0 means only the request's session limit applies."""
        with _as_invalid_argument():
            check_max_generated_tokens(max_generated_tokens, "TurnOptions")
        self._spec = dataclasses.replace(self._spec, max_generated_tokens=max_generated_tokens)

    def set_stop_strings(self, stop_strings: Sequence[str]) -> None:
        """End the turn with STOP_SEQUENCE when the generated text contains one of these (not emitted)."""
        with _as_invalid_argument():
            stops = check_stop_strings(stop_strings, "TurnOptions")
        self._spec = dataclasses.replace(self._spec, stop_strings=stops)

    def set_logprobs(self, num_logprobs: int) -> None:
        """Attach the sampled token's logprob and the top ``num_logprobs`` alternatives to TOKEN events."""
        with _as_invalid_argument():
            check_num_logprobs(num_logprobs, "TurnOptions")
        self._spec = dataclasses.replace(self._spec, num_logprobs=num_logprobs)

    def set_guidance(self, kind: str | None, data: object = "") -> None:
        """Constrain this turn's output (kinds as ``GeneratorParams.set_guidance``), overriding the params;
        ``kind=None`` makes the turn unconstrained even when the params set guidance. Refused like there."""
        guidance = _compiled_guidance(kind, data)
        self._spec = dataclasses.replace(self._spec, guidance_set=True, guidance=guidance)

    @property
    def spec(self) -> TurnSpec:
        return self._spec


def _compiled_guidance(kind: str | None, data: object) -> GuidanceSpec | None:
    """None for ``kind=None``, else the compiled spec; an InvalidArgumentError (field "guidance") if not."""
    if kind is None:
        return None
    try:
        return compile_guidance(kind, data)
    except GuidanceError as exc:
        raise InvalidArgumentError(str(exc), "guidance") from exc


def new_cursor(model: DecoderModel, guidance: GuidanceSpec | None) -> GrammarCursor | None:
    """A fresh grammar cursor of ``guidance`` on ``model``'s tokenizer (None without guidance); refuses a
    grammar that fails against the tokenizer with an InvalidArgumentError (field "guidance")."""
    if guidance is None:
        return None
    try:
        return GrammarCursor.for_model(model, guidance)
    except GuidanceError as exc:
        raise InvalidArgumentError(str(exc), "guidance") from exc


@contextlib.contextmanager
def _as_invalid_argument() -> Iterator[None]:
    """Report a shared sampling rule's refusal as the engine API's InvalidArgumentError (same field)."""
    try:
        yield
    except SamplingOptionsError as exc:
        raise InvalidArgumentError(str(exc), exc.field) from exc


def validate_token_ids(token_ids: object, vocab_size: int) -> list[int]:
    """``token_ids`` copied to a list of ints; InvalidArgumentError if empty, not ints, out of range."""
    if isinstance(token_ids, (str, bytes)):
        raise InvalidArgumentError("token_ids must be a sequence of ints, got a string")
    try:
        array = np.asarray(token_ids)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"token_ids must be a sequence of ints: {exc}") from exc
    if array.ndim != 1 or array.size == 0:
        raise InvalidArgumentError(
            f"token_ids must be a non-empty 1-D sequence of ints, got shape {array.shape}"
        )
    if array.dtype.kind not in "iu":
        raise InvalidArgumentError(f"token_ids must be ints, got dtype {array.dtype}")
    low, high = int(array.min()), int(array.max())
    if low < 0 or high >= vocab_size:
        raise InvalidArgumentError(f"token ids must lie in [0, {vocab_size}), got min {low} and max {high}")
    return array.tolist()


@dataclass(slots=True, eq=False)
class RequestState:
    """The engine-owned state of one request. Only the engine mutates it, on its owner thread.

    Step staging never touches these fields: a committed step publishes a token, the processed length, the
    turn's generated count and the status together (``commit_step``); a rolled-back step leaves them as they
    were. ``sampler``, ``stop_matcher`` and ``cursor`` are mutated by sampling and staging and are
    checkpointed by the transaction.
    """

    request_id: int
    handle_ref: weakref.ref[Request]
    sampler: RequestSampler
    max_total_tokens: int
    eos_token_ids: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)  # every generated token of the request, in order
    processed_len: int = 0
    status: RequestStatus = RequestStatus.UNASSIGNED
    turn_id: int = 0
    turn_prompt_tokens: int = 0
    turn_generated_tokens: int = 0
    total_generated_tokens: int = 0
    finish_reason: FinishReason = FinishReason.NONE
    turn: TurnSpec = field(default_factory=TurnSpec)
    stop_matcher: StopStringMatcher | None = None
    guidance: GuidanceSpec | None = None  # the params' guidance, snapshotted at create_request
    cursor: GrammarCursor | None = None  # the current turn's grammar cursor (None: unconstrained, or ended)
    # Logprobs of the tokens the stop matcher still holds back, oldest first (released in the same order).
    held_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    num_pending_events: int = 0
    first_prompt_len: int = 0
    # Speculative drafts proposed for the next decode (request.set_draft_tokens); consumed by the committed
    # step that schedules the request, untouched by a rolled-back one.
    draft_tokens: tuple[int, ...] = ()
    drafts_proposed: int = 0  # drafts committed steps verified (drafts cut by the step budget not counted)
    drafts_accepted: int = 0  # of those, accepted (the prefix that matched the model)
    turn_reuse: TurnReuse = TurnReuse(0, 0)  # what the turn's first input step did not compute
    block_hashes: BlockHashes | None = None  # chained digests of ``tokens``' full blocks (prefix caching)
    priority: int = 0  # scheduler stamp of the current turn's submission: lower runs first, never re-stamped
    deferrals: int = 0  # committed steps this waiting request was deferred for capacity in a row (aging)
    last_scheduled: int = 0  # scheduler tick of the last committed step that ran it (idle LRU order)

    @property
    def handle(self) -> Request | None:
        return self.handle_ref()

    @property
    def num_unprocessed(self) -> int:
        return len(self.tokens) - self.processed_len

    @property
    def ready_for_drafts(self) -> bool:
        """ACTIVE past prefill with exactly the one token its previous step sampled left to process."""
        return (
            self.status is RequestStatus.ACTIVE
            and self.turn_generated_tokens > 0
            and len(self.tokens) - self.processed_len == 1
        )

    def snapshot(self) -> dict[str, object]:
        """Every field as a comparable value (lists as tuples; the sampler, stop matcher, grammar cursor and
        block hashes by their own ``snapshot()``), the handle's weak reference left out. A new field is
        covered without any change here: a rolled-back step or a refused call must leave this equal."""
        return {
            f.name: _comparable(getattr(self, f.name))
            for f in dataclasses.fields(self)
            if f.name != "handle_ref"
        }

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.turn_prompt_tokens,
            generated_tokens=self.turn_generated_tokens,
            cached_prompt_tokens=self.turn_reuse.cached_prompt_tokens,
            reused_tokens=self.turn_reuse.reused_tokens,
        )

    @property
    def turn_input_start(self) -> int:
        """Position of the current turn's first input token in ``tokens``."""
        return len(self.tokens) - self.turn_prompt_tokens - self.turn_generated_tokens

    def reuse_from(self, past_len: int) -> TurnReuse:
        """The turn's reuse when its input computation starts at ``past_len`` (a resident's processed length,
        or the end of an admission's cached prefix)."""
        cached = max(0, min(past_len - self.turn_input_start, self.turn_prompt_tokens))
        return TurnReuse(past_len, cached)

    @property
    def turn_input_pending(self) -> bool:
        """No token of the turn's input is processed yet (its next step is the turn's first input step)."""
        return self.turn_generated_tokens == 0 and self.processed_len <= self.turn_input_start

    def check_turn_input(self, num_tokens: int) -> None:
        """Refuse input that leaves no room for one generated token below ``max_total_tokens``."""
        if len(self.tokens) + num_tokens >= self.max_total_tokens:
            raise SessionLimitError(
                f"the request holds {len(self.tokens)} tokens and the turn adds {num_tokens}; "
                f"max_session_tokens {self.max_total_tokens} leaves no room for a generated token"
            )

    def start_turn(
        self,
        tokens: list[int],
        spec: TurnSpec,
        stop_matcher: StopStringMatcher | None,
        cursor: GrammarCursor | None = None,
    ) -> int:
        """Append a validated input fragment and queue a new turn; returns the new turn id. Cannot fail."""
        if not self.tokens:
            self.first_prompt_len = len(tokens)
        self.tokens.extend(tokens)
        self.turn_id += 1
        self.turn = spec
        self.turn_prompt_tokens = len(tokens)
        self.turn_generated_tokens = 0
        self.turn_reuse = TurnReuse(0, 0)
        self.finish_reason = FinishReason.NONE
        self.stop_matcher = stop_matcher
        self.cursor = cursor
        self.held_logprobs = []
        self.draft_tokens = ()
        self.status = RequestStatus.ASSIGNED
        return self.turn_id


class Request:
    """The caller's handle of one request; every method must be called on the engine's owner thread.

    Created by ``Engine.create_request``. ``event.request`` is this very object. Dropping the last reference
    without ``close()`` abandons the request: the engine reclaims it and its blocks at its next boundary.
    """

    __slots__ = ("_engine", "_state", "_finalizer", "__weakref__")

    def __init__(self, engine: Engine, state_factory: Callable[[weakref.ref[Request]], RequestState]):
        self._engine = engine
        self._state: RequestState = state_factory(weakref.ref(self))
        self._finalizer = weakref.finalize(self, engine._abandoned.append, self._state.request_id)

    def begin_turn(self, token_ids: Sequence[int], turn_options: TurnOptions | None = None) -> int:
        """Queue the next input fragment; returns the new turn id (1, 2, ...). EngineError on misuse."""
        return self._engine._begin_turn(self, token_ids, turn_options)

    def cancel_turn(self, turn_id: int) -> bool:
        """Finish the named queued or active turn as CANCELLED; False for a stale, unknown or completed id."""
        return self._engine._cancel_turn(self, operator.index(turn_id))

    def set_draft_tokens(self, draft_tokens: Sequence[int]) -> None:
        """Propose tokens that continue this request; the next step that schedules it verifies them.

        The request must be ACTIVE and decode-ready (``ready_for_drafts``); at most
        ``engine.max_draft_tokens_per_proposal()`` ids, each inside the vocabulary. A new proposal replaces a
        pending one; ``[]`` clears it (legal in any open state). Misuse raises an ``EngineError`` and changes
        nothing. Output is unchanged by drafts: greedy turns emit exactly their greedy tokens, sampled turns
        keep their distribution (docs/engine.md, "Speculative drafts").
        """
        self._engine._set_draft_tokens(self, draft_tokens)

    @property
    def ready_for_drafts(self) -> bool:
        """Whether ``set_draft_tokens`` would accept a proposal now (ACTIVE, past prefill, one token left)."""
        return self._state.ready_for_drafts

    @property
    def draft_tokens(self) -> tuple[int, ...]:
        """The pending proposal (empty once a committed step consumed it)."""
        return self._state.draft_tokens

    @property
    def drafts_proposed(self) -> int:
        """Draft tokens of this request that committed steps verified."""
        return self._state.drafts_proposed

    @property
    def drafts_accepted(self) -> int:
        """Of :attr:`drafts_proposed`, those the model accepted."""
        return self._state.drafts_accepted

    @property
    def draft_acceptance_rate(self) -> float:
        """``drafts_accepted / drafts_proposed`` (0.0 before any draft was verified)."""
        s = self._state
        return s.drafts_accepted / s.drafts_proposed if s.drafts_proposed else 0.0

    def close(self) -> None:
        """End the request from any state (idempotent); frees its blocks and purges its pending events."""
        self._engine._close_request(self)

    @property
    def id(self) -> int:
        return self._state.request_id

    @property
    def status(self) -> RequestStatus:
        return self._state.status

    @property
    def turn_id(self) -> int:
        """The current (latest) turn id; 0 before the first turn."""
        return self._state.turn_id

    @property
    def finish_reason(self) -> FinishReason:
        return self._state.finish_reason

    @property
    def tokens(self) -> tuple[int, ...]:
        """The logical sequence: prompt, generated output and continuation input (EOS never included)."""
        return tuple(self._state.tokens)

    @property
    def sequence_length(self) -> int:
        return len(self._state.tokens)

    @property
    def processed_length(self) -> int:
        """Tokens of the sequence already represented in the committed KV cache."""
        return self._state.processed_len

    @property
    def seed(self) -> int:
        """The seed of this request's random stream (drawn fresh when the params gave none)."""
        return self._state.sampler.seed

    def __repr__(self) -> str:
        s = self._state
        return (
            f"Request(id={s.request_id}, status={s.status.name}, turn_id={s.turn_id}, tokens={len(s.tokens)})"
        )


def _comparable(value: object) -> object:
    """``value`` as something ``==`` compares by content: a part's ``snapshot()``, a list as a tuple."""
    snapshot = getattr(value, "snapshot", None)
    if callable(snapshot):
        return snapshot()
    if isinstance(value, list):
        return tuple(value)
    return value
