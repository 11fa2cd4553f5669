"""From one sampled token to a staged request result and its events (shared by the dynamic and static paths).

Staging decides, without touching committed request fields, whether a token is appended, whether the turn
ends and why, and which events the caller will see; it mutates only state the transaction checkpoints (the
stop matcher, the grammar cursor, held logprobs), and :func:`commit_staged` publishes the rest. The end
conditions in their order: docs/engine.md, "Staging a token".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedgen.engine.events import (
    EngineEvent,
    EngineEventFlags,
    FinishReason,
    TokenLogprobs,
    TurnReuse,
    Usage,
)
from pagedgen.engine.request import RequestState, RequestStatus
from pagedgen.errors import EngineErrorCode, GuidanceError
from pagedgen.sampling import SampledToken, SampleRow


@dataclass(slots=True)
class StagedResult:
    """What committing one scheduled row will publish."""

    state: RequestState
    target_processed: int  # processed length after commit (the cache's committed slots)
    tokens: list[int] = field(default_factory=list)  # appended to the sequence (none: partial prefill, EOS)
    finish: FinishReason = FinishReason.NONE
    events: list[EngineEvent] = field(default_factory=list)
    num_drafts: int = 0  # drafts this row verified
    num_accepted: int = 0  # of those, accepted
    reuse: TurnReuse | None = None  # set by the turn's first input step: what it did not compute


def sample_row(state: RequestState, eos_token_ids: tuple[int, ...]) -> SampleRow:
    """The sampler's view of ``state`` (the sampling seam: what the batched sampler may read)."""
    return SampleRow(
        sampler=state.sampler,
        tokens=state.tokens,
        num_prompt_tokens=state.first_prompt_len,
        generated=state.generated,
        turn_generated=state.turn_generated_tokens,
        eos_token_ids=eos_token_ids,
        num_logprobs=state.turn.num_logprobs,
    )


def stage_sampled(
    state: RequestState, sampled: SampledToken, seq_len: int, reuse: TurnReuse | None = None
) -> StagedResult:
    """Stage the token sampled after the request's last input token (sequence length ``seq_len``);
    ``reuse``: set by the turn's first input step."""
    return stage_outputs(state, [sampled], seq_len, reuse=reuse)


def stage_outputs(
    state: RequestState,
    outputs: Sequence[SampledToken],
    seq_len: int,
    num_drafts: int = 0,
    num_accepted: int = 0,
    reuse: TurnReuse | None = None,
) -> StagedResult:
    """Stage a row's outputs in order: output ``j`` (from 1) was sampled after the row's last input token
    followed by outputs ``1..j-1`` (accepted drafts). Stops at the first output that ends the turn.

    The committed length covers the inputs whose logits were used: ``seq_len + used - 1``, so the last
    appended token stays the one unprocessed token, exactly as without drafts. ``reuse``: set by the turn's
    first input step (never a row with drafts, which only a decode verifies).
    """
    tokens: list[int] = []
    released: list[tuple[int, TokenLogprobs | None]] = []
    finish, matched, text_before_stop, used = FinishReason.NONE, None, "", 0
    for sampled in outputs:
        used += 1
        if sampled.token in state.eos_token_ids:
            finish = FinishReason.EOS
            released += _flush(state)
            break
        tokens.append(sampled.token)
        if state.cursor is not None:  # raises GuidanceError (the step fails this request) on a rejection
            state.cursor.consume(sampled.token)
        logprobs = None
        if state.turn.num_logprobs and sampled.logprob is not None:
            logprobs = TokenLogprobs(sampled.logprob, tuple(sampled.top_logprobs))
        fed, matched, text_before_stop = _feed(state, sampled.token, logprobs)
        released += fed
        finish = _limit_reached(state, matched, len(tokens), seq_len)
        if finish is FinishReason.STOP_SEQUENCE:
            state.held_logprobs.clear()
        elif finish is not FinishReason.NONE:
            released += _flush(state)
        if finish is not FinishReason.NONE:
            break
    generated = state.turn_generated_tokens + len(tokens)
    events = turn_events(
        state, released, finish, generated, matched, text_before_stop=text_before_stop, reuse=reuse
    )
    return StagedResult(
        state,
        seq_len + used - 1,
        tokens,
        finish,
        events,
        num_drafts=num_drafts,
        num_accepted=num_accepted,
        reuse=reuse,
    )


def _limit_reached(state: RequestState, matched: int | None, num_new: int, seq_len: int) -> FinishReason:
    """Why the turn ends after its ``num_new``-th appended output of this step (NONE: it goes on).

    A complete grammar ends the turn as EOS would (only EOS could follow, so it is not sampled): after a
    stop string, before the limits, since the output is whole.
    """
    if matched is not None:
        return FinishReason.STOP_SEQUENCE
    if state.cursor is not None and state.cursor.complete:
        return FinishReason.EOS
    limit = state.turn.max_generated_tokens
    if limit and state.turn_generated_tokens + num_new >= limit:
        return FinishReason.MAX_GENERATED_TOKENS
    if seq_len + num_new >= state.max_total_tokens:
        return FinishReason.MAX_SESSION_TOKENS
    return FinishReason.NONE


def _feed(
    state: RequestState, token: int, logprobs: TokenLogprobs | None
) -> tuple[list[tuple[int, TokenLogprobs | None]], int | None, str]:
    """Pass a generated token through the stop matcher.

    Returns the released (token, logprobs), the matched stop index and, with a match, the text between the
    last released token and the stop string.
    """
    if state.stop_matcher is None:
        return [(token, logprobs)], None, ""
    state.held_logprobs.append(logprobs)
    update = state.stop_matcher.feed(token)
    released = list(zip(update.release, state.held_logprobs[: len(update.release)], strict=True))
    del state.held_logprobs[: len(update.release)]
    return released, update.matched, update.text_before_match


def _flush(state: RequestState) -> list[tuple[int, TokenLogprobs | None]]:
    """The turn ends for a non-stop reason: release whatever the stop matcher holds, oldest first."""
    if state.stop_matcher is None:
        return []
    tokens = state.stop_matcher.flush()
    released = list(zip(tokens, state.held_logprobs[: len(tokens)], strict=True))
    state.held_logprobs.clear()
    return released


def turn_events(
    state: RequestState,
    released: list[tuple[int, TokenLogprobs | None]],
    finish: FinishReason,
    generated_tokens: int,
    matched: int | None = None,
    error_code: EngineErrorCode = EngineErrorCode.NONE,
    text_before_stop: str = "",
    reuse: TurnReuse | None = None,
) -> list[EngineEvent]:
    """TOKEN events for ``released`` and, when the turn finishes, TURN_FINISHED merged into the last one.

    ``reuse`` overrides the turn's committed reuse (a turn whose first input step also finishes it).

    Returns no events when the caller's handle is gone (an abandoned request is reclaimed, not reported).
    """
    handle = state.handle
    if handle is None:
        return []
    events = [
        EngineEvent(
            request=handle,
            turn_id=state.turn_id,
            flags=EngineEventFlags.TOKEN,
            token=token,
            logprobs=logprobs,
            request_id=state.request_id,
        )
        for token, logprobs in released
    ]
    if finish is FinishReason.NONE:
        return events
    if not events:
        events.append(
            EngineEvent(
                request=handle,
                turn_id=state.turn_id,
                flags=EngineEventFlags.NONE,
                request_id=state.request_id,
            )
        )
    last = events[-1]
    last.flags |= EngineEventFlags.TURN_FINISHED
    if finish is FinishReason.FAILED:
        last.flags |= EngineEventFlags.FAILED
    last.finish_reason = finish
    reuse = state.turn_reuse if reuse is None else reuse
    last.usage = Usage(
        prompt_tokens=state.turn_prompt_tokens,
        generated_tokens=generated_tokens,
        cached_prompt_tokens=reuse.cached_prompt_tokens,
        reused_tokens=reuse.reused_tokens,
    )
    last.matched_stop_string_index = matched
    last.text_before_stop = text_before_stop
    last.error_code = error_code
    return events


def commit_staged(staged: StagedResult) -> None:
    """Publish a staged row into its request: token, counts, processed length, status. Cannot fail."""
    state = staged.state
    state.tokens.extend(staged.tokens)
    state.generated.extend(staged.tokens)
    state.turn_generated_tokens += len(staged.tokens)
    state.draft_tokens = ()  # the step consumed the proposal, drafts cut by its budget included
    state.drafts_proposed += staged.num_drafts
    state.drafts_accepted += staged.num_accepted
    state.processed_len = staged.target_processed
    if staged.reuse is not None:
        state.turn_reuse = staged.reuse
    state.finish_reason = staged.finish
    if staged.finish is FinishReason.NONE:
        state.status = RequestStatus.ACTIVE
    else:
        state.status = RequestStatus.TURN_COMPLETE
        state.cursor = None  # the turn's grammar is done with


def fail_turn_now(state: RequestState, cause: BaseException | None = None) -> list[EngineEvent]:
    """End the current turn FAILED (failure isolation). A failure of its constraint (an llguidance limit,
    a mask past its step budget) is GUIDANCE_FAILED with the cause's text, anything else REQUEST_FAILED."""
    if isinstance(cause, GuidanceError):
        return finish_turn_now(state, FinishReason.FAILED, EngineErrorCode.GUIDANCE_FAILED, str(cause))
    return finish_turn_now(state, FinishReason.FAILED, EngineErrorCode.REQUEST_FAILED)


def finish_turn_now(
    state: RequestState,
    reason: FinishReason,
    error_code: EngineErrorCode = EngineErrorCode.NONE,
    error_message: str = "",
) -> list[EngineEvent]:
    """End the current turn outside a step (cancel, unserviceable, fatal failure); returns its events.

    Held stop-matcher tokens are released first so no generated output is silently lost (except on FAILED,
    where the turn's output is no longer trusted).
    """
    released = [] if reason is FinishReason.FAILED else _flush(state)
    state.held_logprobs.clear()
    state.cursor = None
    state.draft_tokens = ()
    state.status = RequestStatus.TURN_COMPLETE
    state.finish_reason = reason
    events = turn_events(state, released, reason, state.turn_generated_tokens, error_code=error_code)
    if events:
        events[-1].error_message = error_message
    return events
