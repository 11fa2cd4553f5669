"""Request-level invariants: lifecycle, counters, scheduler membership and event accounting agree.

Pure: reads engine state and returns the violations (empty when consistent). The engine runs these plus the
path's own checks (cache accounting for the dynamic path) after every step when
``EngineConfig(debug_invariants=True)``; the tests run them after every public operation.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from pagedgen.engine.events import EngineEvent, FinishReason
from pagedgen.engine.request import RequestState, RequestStatus

if TYPE_CHECKING:
    from pagedgen.engine.roles import EngineScheduler


def request_violations(
    states: Mapping[int, RequestState], scheduler: EngineScheduler, pending: Iterable[EngineEvent]
) -> list[str]:
    """Every inconsistency between the registered requests, the scheduler and the retained events."""
    problems: list[str] = []
    pending_counts = Counter(e.request_id for e in pending if e.request_id is not None)
    for rid, state in states.items():
        problems += _state_violations(rid, state, scheduler.is_resident(state))
        if pending_counts[rid] != state.num_pending_events:
            problems.append(
                f"request {rid}: {pending_counts[rid]} retained events, counter {state.num_pending_events}"
            )
    for rid in set(pending_counts) - set(states):
        problems.append(f"{pending_counts[rid]} retained events name unregistered request {rid}")
    return problems + scheduler.violations(states)


def _state_violations(rid: int, state: RequestState, resident: bool) -> list[str]:
    problems = []
    status = state.status
    if state.request_id != rid:
        problems.append(f"request filed under {rid} has id {state.request_id}")
    if status is RequestStatus.CLOSED:
        problems.append(f"request {rid} is closed but still registered")
    if not 0 <= state.processed_len <= len(state.tokens):
        problems.append(f"request {rid}: processed {state.processed_len} of {len(state.tokens)} tokens")
    if len(state.tokens) >= state.max_total_tokens + (status is RequestStatus.TURN_COMPLETE):
        problems.append(
            f"request {rid}: {len(state.tokens)} tokens reach max_total_tokens {state.max_total_tokens}"
        )
    if state.turn_generated_tokens > len(state.generated) or len(state.generated) > len(state.tokens):
        problems.append(f"request {rid}: generated counters exceed the sequence")
    if (status is RequestStatus.UNASSIGNED) != (state.turn_id == 0):
        problems.append(f"request {rid}: status {status.value} with turn id {state.turn_id}")
    if status is RequestStatus.UNASSIGNED and (state.tokens or resident):
        problems.append(f"request {rid}: unassigned but holds tokens or cache")
    if status is RequestStatus.ACTIVE and not resident:
        problems.append(f"request {rid}: active but not cache-resident")
    if status.executable and (state.finish_reason is not FinishReason.NONE or state.num_unprocessed < 1):
        problems.append(f"request {rid}: {status.value} with finish {state.finish_reason} and no input")
    if status is RequestStatus.TURN_COMPLETE and state.finish_reason is FinishReason.NONE:
        problems.append(f"request {rid}: turn complete without a finish reason")
    return problems
