"""Caller-supplied speculative drafts on the synthetic model: exact tokens whatever the drafts.

The synthetic model's greedy continuation is a closed formula read back through the block table, so a
correct, wrong or partly correct draft must leave the emitted tokens exactly the greedy ones, and a rejected
draft whose K/V became visible would change the next tokens. Greedy runs with drafts publish exactly the
events of runs without them (one TOKEN event per token, in order, the terminal event merged into the last),
whatever the batch composition, the limits that end the turn (EOS, stop string, max_generated_tokens,
max_session_tokens) and the faults injected at every phase. Sampled turns verify by rejection sampling: their
tokens depend only on their own seed and drafts (same in any batch), and the distribution is proven in
tests/unit/test_sampling_drafts.py.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pagedgen as pg
from pagedgen.engine.faults import FaultInjector
from pagedgen.errors import ExecutionCapacityError, InjectedFault, RetryableExecutionError
from pagedgen.models.synthetic import synthetic_greedy
from tests import helpers
from tests.helpers import (
    VOCAB,
    SyntheticFamily,
    drain,
    engine_snapshot,
    event_key,
    expected_greedy,
    make_engine,
    record_steps,
    submit,
    synthetic_model,
    tokens_of,
)
from tests.helpers.drafts import Policy, correct, partly, run_with, truth, wrong

F = pg.EngineEventFlags
E = pg.EngineErrorCode
R = pg.FinishReason


def keys(events: list[pg.EngineEvent]) -> list[tuple]:
    return [(*event_key(e), e.matched_stop_string_index, e.text_before_stop) for e in events]


def outcome(events: list[pg.EngineEvent]) -> tuple:
    """The tokens and the terminal payload, whatever the grouping: a step that accepts drafts right before
    its turn ends (EOS, stop string) merges the terminal flag into its last TOKEN event, where a run without
    drafts may end with a token-less terminal event."""
    tokens = [e.token for e in events if e.flags & F.TOKEN]
    (end,) = [e for e in events if e.flags & F.TURN_FINISHED]
    return tokens, end.finish_reason, end.usage, end.matched_stop_string_index, end.text_before_stop


def reference_events(prompt: list[int], max_new: int = 0, **kwargs) -> list[pg.EngineEvent]:
    """The events of the same turn without drafts (model options ``eos_token_id``, the rest for submit)."""
    model_kwargs = {k: kwargs.pop(k) for k in ("eos_token_id",) if k in kwargs}
    engine = make_engine(synthetic_model(**model_kwargs), block_size=4)
    request = submit(engine, prompt, max_new, **kwargs)  # held: a dropped request is reclaimed silently
    events = drain(engine)
    assert request.status is pg.RequestStatus.TURN_COMPLETE
    return events


def reference(prompt: list[int], max_new: int = 0, **kwargs) -> list[tuple]:
    return keys(reference_events(prompt, max_new, **kwargs))


# -- exact tokens --------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("kind", ["correct", "wrong", "partly"])
def test_drafts_never_change_greedy_tokens(kind, k):
    steps: list = []
    engine = make_engine(block_size=4, wrap_runner=record_steps(steps))
    request = submit(engine, [3, 4, 5], 40)
    policy = {"correct": correct(k), "wrong": wrong(k), "partly": partly(k // 2, k)}[kind]
    events = run_with(engine, {request: policy})
    assert tokens_of(events)[request] == expected_greedy([3, 4, 5], 40)
    assert keys(events) == reference([3, 4, 5], 40)
    proposed, accepted = request.drafts_proposed, request.drafts_accepted
    assert proposed > 0 and engine.stats().drafts_proposed == proposed
    assert engine.stats().drafts_accepted == accepted
    if kind == "correct":
        assert accepted == proposed and request.draft_acceptance_rate == 1.0
        assert len(steps) <= 1 + -(-39 // (k + 1))  # prefill, then k+1 tokens per decode step
    elif kind == "wrong":
        assert accepted == 0 and len(steps) == 40
    else:
        assert accepted == (k // 2) * (len(steps) - 1) - _cut(steps, k, k // 2)
    assert all(q <= k + 1 for qs, _ in steps[1:] for q in qs)


def _cut(steps, k: int, j: int) -> int:
    """Accepted drafts that the turn's end cut from a partly-correct policy's last steps (0 if none)."""
    return sum(max(0, j - (qs[0] - 1)) for qs, _ in steps[1:] if qs[0] - 1 < k)


def test_rejected_drafts_never_become_visible():
    """Every rejected draft wrote K/V past the committed length; the next step reads its own tokens there."""
    steps: list = []
    engine = make_engine(block_size=4, wrap_runner=record_steps(steps))
    request = submit(engine, [9, 8], 12)
    events = run_with(engine, {request: wrong(5)})
    assert tokens_of(events)[request] == expected_greedy([9, 8], 12)
    # After each decode the committed length grew by one, although five more slots were written.
    pasts = [past[0] for _, past in steps]
    assert pasts == list(range(0, 2)) + list(range(2, 13)) or pasts == [0] + list(range(2, 13))
    assert request.processed_length == request.sequence_length - 1


@settings(max_examples=40, deadline=None)
@given(
    turns=st.lists(
        st.tuples(
            st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=14),  # prompt
            st.integers(1, 12),  # max new tokens
            st.sampled_from(["none", "correct", "wrong", "partly"]),
            st.integers(1, 6),  # k
            st.booleans(),  # sampled
        ),
        min_size=1,
        max_size=4,
    ),
    max_tokens=st.integers(4, 24),
    num_blocks=st.integers(28, 40),  # 4 requests of <= 26 tokens: never all stuck without preemption
)
def test_any_batch_composition_matches_isolated_runs(turns, max_tokens, num_blocks):
    def build(selected, **config):
        engine = make_engine(block_size=4, chunk_size=5, **config)
        policies, requests = {}, []
        for prompt, max_new, kind, k, sampled in selected:
            search = {"do_sample": True, "temperature": 1.5, "seed": len(prompt)} if sampled else {}
            request = submit(engine, prompt, max_new, **search)
            policy = {"none": lambda r: [], "correct": correct(k), "wrong": wrong(k)}.get(kind, partly(1, k))
            policies[request] = policy
            requests.append(request)
        return engine, requests, policies

    engine, requests, policies = build(turns, max_scheduled_tokens=max_tokens, num_blocks=num_blocks)
    events = run_with(engine, policies, capacity=3, close_finished=True)
    got = tokens_of(events)
    for turn, request in zip(turns, requests, strict=True):
        prompt, max_new, _, k, sampled = turn
        alone, (only,), policy = build([(prompt, max_new, "none", k, sampled)], num_blocks=64)
        expected = tokens_of(run_with(alone, policy))[only]  # alone, without drafts
        assert got[request] == expected
        if not sampled:
            assert expected == expected_greedy(prompt, max_new)
        request.close()
    stats = engine.stats()
    assert stats.free_blocks == stats.total_blocks


# -- turn ends inside the drafts -----------------------------------------------------------------------


def test_eos_inside_accepted_drafts_ends_the_turn_there():
    eos = 7
    prompt = _prompt_reaching(lambda out: eos in out[2:5], eos_free=False, eos=eos)
    engine = make_engine(synthetic_model(eos_token_id=eos), block_size=4)
    request = submit(engine, prompt, 20)
    events = run_with(engine, {request: correct(8)})  # drafts run past the EOS
    assert outcome(events) == outcome(reference_events(prompt, 20, eos_token_id=eos))
    assert events[-1].finish_reason is R.EOS and events[-1].flags & F.TOKEN
    assert eos not in request.tokens[len(prompt) :]
    assert request.processed_length == request.sequence_length  # like an EOS sampled without drafts


def test_stop_string_inside_accepted_drafts_ends_the_turn_there():
    prompt = [3, 4, 5]
    out = expected_greedy(prompt, 20)
    tokenizer = synthetic_model().tokenizer
    stop = tokenizer.decode(out[5:7])
    engine = make_engine(block_size=4)
    request = submit(engine, prompt, 20, stop_strings=[stop])
    events = run_with(engine, {request: correct(8)})
    assert outcome(events) == outcome(reference_events(prompt, 20, stop_strings=[stop]))
    assert events[-1].finish_reason is R.STOP_SEQUENCE
    assert list(request.tokens) == prompt + out[: len(request.tokens) - len(prompt)]
    assert len(request.tokens) <= len(prompt) + 7  # nothing after the stop string was appended


@pytest.mark.parametrize("limit", ["max_generated_tokens", "max_session_tokens"])
def test_limits_cut_drafts_that_could_never_be_emitted(limit):
    prompt = [3, 4, 5]
    options = {"max_new": 6} if limit == "max_generated_tokens" else {"max_new": 0, "max_session_tokens": 9}
    steps: list = []
    engine = make_engine(block_size=4, wrap_runner=record_steps(steps))
    request = submit(
        engine, prompt, options["max_new"], max_session_tokens=options.get("max_session_tokens", 0)
    )
    events = run_with(engine, {request: correct(8)})
    assert keys(events) == reference(
        prompt, options["max_new"], max_session_tokens=options.get("max_session_tokens", 0)
    )
    # The prefill emits one token; five are left, so 1 token + 4 drafts: the fifth output ends the turn.
    assert [qs for qs, _ in steps] == [[3], [5]]
    assert request.drafts_proposed == request.drafts_accepted == 4
    assert events[-1].finish_reason is R[limit.upper()]


def test_cancel_discards_the_pending_proposal():
    engine = make_engine(block_size=4)
    request = submit(engine, [3, 4, 5], 20)
    engine.run(max_events=64)
    request.set_draft_tokens([1, 2, 3])
    assert request.draft_tokens == (1, 2, 3)
    assert request.cancel_turn(request.turn_id)
    assert request.draft_tokens == ()
    (event,) = engine.run(max_events=64)
    assert event.finish_reason is R.CANCELLED
    request.begin_turn([6], helpers.turn_options(request, 3))
    assert request.draft_tokens == () and request.drafts_proposed == 0


# -- events, budget, blocks ----------------------------------------------------------------------------


def test_one_event_per_token_and_overflow_drains_without_a_step():
    engine = make_engine(block_size=4)
    request = submit(engine, [3, 4, 5], 20)
    engine.run(max_events=64)  # prefill: one token
    request.set_draft_tokens(truth(request, 4))
    events = list(engine.run(max_events=1))
    steps = engine.stats().steps
    while engine.stats().pending_events:
        events += engine.run(max_events=1)
    assert engine.stats().steps == steps
    expected = expected_greedy([3, 4, 5], 6)[1:]
    assert [e.token for e in events] == expected and all(e.flags == F.TOKEN for e in events)
    assert request.draft_tokens == () and request.drafts_accepted == 4


def test_proposal_waits_for_a_step_that_schedules_its_request():
    faults = FaultInjector()
    engine = make_engine(block_size=4, max_batch_size=1, faults=faults)
    first = submit(engine, [3, 4, 5], 3)
    engine.run(max_events=64)
    first.set_draft_tokens(truth(first, 1))
    before = engine_snapshot(engine)
    faults.arm("execute", RetryableExecutionError("transient"))
    engine.run(max_events=64)
    assert engine_snapshot(engine) == before  # the rollback restored the proposal exactly
    assert first.draft_tokens == tuple(truth(first, 1))
    run_with(engine, {})
    assert first.drafts_proposed == first.drafts_accepted == 1


def test_budget_gives_drafts_only_what_mandatory_decodes_leave():
    steps: list = []
    engine = make_engine(block_size=4, max_scheduled_tokens=5, wrap_runner=record_steps(steps))
    requests = [submit(engine, [i, i + 1], 12) for i in range(1, 4)]
    events = run_with(engine, {r: correct(4) for r in requests})
    for i, request in enumerate(requests, start=1):
        assert tokens_of(events)[request] == expected_greedy([i, i + 1], 12)
    decode_steps = [qs for qs, _ in steps if all(q <= 5 for q in qs) and len(qs) == 3]
    assert decode_steps and all(sum(qs) <= 5 and min(qs) >= 1 for qs in decode_steps)
    assert any(qs[0] == 3 and qs[1:] == [1, 1] for qs in decode_steps)  # the first decode took the budget


def test_free_blocks_cut_drafts_without_deferring_anyone():
    steps: list = []
    engine = make_engine(block_size=4, num_blocks=4, wrap_runner=record_steps(steps))
    a = submit(engine, [1, 2, 3], 5)  # 8 tokens: 2 blocks each, the whole pool
    b = submit(engine, [4, 5, 6], 5)
    events = run_with(engine, {a: correct(6), b: correct(6)})
    assert tokens_of(events)[a] == expected_greedy([1, 2, 3], 5)
    assert tokens_of(events)[b] == expected_greedy([4, 5, 6], 5)
    assert not any(e.request is None for e in events)  # never capacity-blocked
    for qs, pasts in steps[1:]:
        assert all(p + q <= 8 for q, p in zip(qs, pasts, strict=True))  # within each table's 2 blocks


def test_windowed_rings_bound_drafts_by_the_chunk_limit():
    steps: list = []
    engine = make_engine(
        synthetic_model(window=3), block_size=4, chunk_size=4, wrap_runner=record_steps(steps)
    )
    assert engine.max_draft_tokens_per_proposal() == 3
    request = submit(engine, [3, 4, 5], 30)
    events = run_with(engine, {request: partly(2, 3)})
    assert tokens_of(events)[request] == expected_greedy([3, 4, 5], 30)
    assert max(q for qs, _ in steps for q in qs) <= 4 and request.drafts_accepted > 0


# -- processors and sampled turns ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "search",
    [
        {"repetition_penalty": 1.5},
        {"no_repeat_ngram_size": 2},
        {"min_new_tokens": 6},
        {"presence_penalty": 1.0, "frequency_penalty": 0.5},
    ],
    ids=["repetition", "no-repeat-ngram", "min-new-tokens", "presence-frequency"],
)
def test_greedy_processors_see_the_accepted_drafts_as_context(search):
    prompt = [5, 5, 6, 5, 5]
    eos = 7
    plain = make_engine(synthetic_model(eos_token_id=eos), block_size=4)
    kept = submit(plain, prompt, 16, **search)
    want = drain(plain)
    assert kept.status is pg.RequestStatus.TURN_COMPLETE
    oracle = [e.token for e in want if e.token is not None]

    def from_reference(request):  # the reference continuation, corrupted after two tokens
        done = len(request.tokens) - len(prompt)
        head = oracle[done : done + 2]
        return head + [(t + 1) % VOCAB for t in oracle[done + 2 : done + 5]]

    engine = make_engine(synthetic_model(eos_token_id=eos), block_size=4)
    request = submit(engine, prompt, 16, **search)
    events = run_with(engine, {request: from_reference})
    assert keys(events) == keys(want) and request.drafts_accepted > 0


@pytest.mark.parametrize("kind", ["correct", "wrong", "partly"])
def test_sampled_turns_emit_exactly_their_tokens_without_drafts(kind):
    """The verifier draws each row with the stream index its token has without drafts (docs/engine.md)."""

    def run(policy):
        engine = make_engine(block_size=4)
        request = submit(engine, [3, 4, 5], 30, do_sample=True, temperature=0.7, seed=5, logprobs=2)
        events = run_with(engine, {request: policy})
        return keys(events), request

    plain, _ = run(lambda r: [])
    policy = {"correct": correct(4), "wrong": wrong(4), "partly": partly(2, 4)}[kind]
    drafted, request = run(policy)
    assert drafted == plain and request.drafts_proposed > 0
    if kind == "correct":  # ~98% of the mass is on the greedy token at temperature 0.7
        assert request.drafts_accepted > 0.7 * request.drafts_proposed
    elif kind == "partly":
        assert request.drafts_accepted > 0


# -- refusals ------------------------------------------------------------------------------------------


def assert_refused(engine, call, error, match):
    before = engine_snapshot(engine)
    with pytest.raises(error, match=match):
        call()
    assert engine_snapshot(engine) == before


def test_bad_proposals_are_refused_without_changing_anything():
    engine = make_engine(block_size=4, max_draft_tokens=3, chunk_size=4)
    ready = submit(engine, [3, 4, 5], 20)
    engine.run(max_events=64)
    assert ready.ready_for_drafts and engine.max_draft_tokens_per_proposal() == 3
    ready.set_draft_tokens([1, 2])
    state_error, invalid = pg.EngineError, pg.EngineError
    assert_refused(engine, lambda: ready.set_draft_tokens([1, 2, 3, 4]), invalid, "exceed")
    assert_refused(engine, lambda: ready.set_draft_tokens([1, VOCAB]), invalid, "lie in")
    assert_refused(engine, lambda: ready.set_draft_tokens([-1]), invalid, "lie in")
    assert_refused(engine, lambda: ready.set_draft_tokens([1.5]), invalid, "ints")
    assert_refused(engine, lambda: ready.set_draft_tokens("ab"), invalid, "string")
    assert_refused(engine, lambda: ready.set_draft_tokens(7), invalid, "sequence")
    assert_refused(engine, lambda: ready.set_draft_tokens([True]), invalid, "ints")
    ready.set_draft_tokens(t for t in (3, 4))  # any iterable of ints
    assert ready.draft_tokens == (3, 4)
    ready.set_draft_tokens([1, 2])
    assert ready.draft_tokens == (1, 2)

    fresh = engine.create_request(pg.GeneratorParams(engine.model))
    assert_refused(engine, lambda: fresh.set_draft_tokens([1]), state_error, "unassigned")
    queued = submit(engine, list(range(20)), 2)
    assert_refused(engine, lambda: queued.set_draft_tokens([1]), state_error, "assigned")
    engine.run(max_events=64)  # queued prefills its first chunk
    assert queued.status is pg.RequestStatus.ACTIVE and not queued.ready_for_drafts
    assert_refused(engine, lambda: queued.set_draft_tokens([1]), state_error, "prefilling")
    done = submit(engine, [1], 1)
    drain(engine)
    assert_refused(engine, lambda: done.set_draft_tokens([1]), state_error, "turn_complete")
    done.set_draft_tokens([])  # clearing is legal in any open state
    done.close()
    assert_refused(engine, lambda: done.set_draft_tokens([1]), state_error, "closed")


@pytest.mark.parametrize(
    "build",
    [
        lambda: make_engine(max_draft_tokens=0),
        lambda: make_engine(dynamic_batching=False),
        lambda: make_engine(synthetic_model(hybrid=True)),
        lambda: make_engine(chunk_size=1),
    ],
    ids=["max_draft_tokens=0", "static", "fixed-state", "chunk_size=1"],
)
def test_engines_that_cannot_verify_drafts_report_zero_and_refuse(build):
    engine = build()
    assert engine.max_draft_tokens_per_proposal() == 0
    request = submit(engine, [3, 4, 5], 4)
    first = list(engine.run(max_events=64))
    assert_refused(
        engine, lambda: request.set_draft_tokens([1]), pg.EngineError, "max_draft_tokens.*: [A-Za-z]"
    )
    request.set_draft_tokens([])
    want = synthetic_greedy([3, 4, 5], 4, VOCAB, hybrid=engine.model.hybrid)
    assert tokens_of(first + drain(engine))[request] == want


def test_max_draft_tokens_is_validated():
    with pytest.raises(pg.EngineError, match="max_draft_tokens"):
        pg.EngineConfig(max_draft_tokens=-1)
    with pytest.raises(pg.EngineError, match="max_draft_tokens"):
        pg.EngineConfig(max_draft_tokens=True)


# -- faults at every phase -----------------------------------------------------------------------------


@pytest.fixture(params=[None, 3], ids=["dense", "window3"])
def family(request) -> SyntheticFamily:
    """The fault tests run on the dense synthetic model and on the windowed one."""
    return SyntheticFamily(request.param)


def scenario(
    family: SyntheticFamily, faults: FaultInjector | None = None
) -> tuple[pg.Engine, dict[str, pg.Request], dict[pg.Request, Policy]]:
    """A greedy decode with correct drafts, one with partly correct drafts, a sampled decode with drafts and
    stop strings, a partial prefill, a waiting request and an idle resident; every proposal is pending
    (``faults``: the engine's injector)."""
    engine = family.engine(block_size=4, num_blocks=64, max_scheduled_tokens=16, chunk_size=4, faults=faults)
    requests = {
        "done": submit(engine, [1, 2], 1),
        "correct": submit(engine, [3, 4, 5], 12),
        "partly": submit(engine, [4, 5], 12),
        "sampled": submit(
            engine, [6, 7], 12, do_sample=True, temperature=1.3, seed=11, stop_strings=["@@"], logprobs=2
        ),
    }
    policies = {
        requests["correct"]: correct(3),
        requests["partly"]: partly(1, 3),
        requests["sampled"]: wrong(2),
    }
    for _ in range(2):
        _step(engine, policies)
    requests["prefill"] = submit(engine, list(range(30, 50)), 3)
    _step(engine, policies)
    requests["waiting"] = submit(engine, [8, 9], 3)
    _propose(engine, policies)
    assert requests["correct"].draft_tokens and requests["sampled"].draft_tokens
    assert 0 < requests["prefill"].processed_length < 20
    return engine, requests, policies


def _propose(engine, policies):
    for request, policy in policies.items():
        if request.ready_for_drafts:
            request.set_draft_tokens(policy(request)[: engine.max_draft_tokens_per_proposal()])


def _step(engine, policies):
    _propose(engine, policies)
    engine.run(max_events=64)
    while engine.stats().pending_events:
        engine.run(max_events=64)


RECOVERABLE = [
    ("checkpoint", InjectedFault("x"), F.RETRYABLE),
    ("pack", InjectedFault("x"), F.RETRYABLE),
    ("execute", RetryableExecutionError("transient"), F.RETRYABLE),
    ("execute", ExecutionCapacityError("oom"), F.CAPACITY_BLOCKED),
    ("sample", InjectedFault("x"), F.RETRYABLE),
    ("stage", InjectedFault("x"), F.RETRYABLE),
    ("validate", InjectedFault("x"), F.RETRYABLE),
]


@pytest.mark.parametrize(
    "phase, error, flag", RECOVERABLE, ids=[f"{p}-{type(e).__name__}" for p, e, _ in RECOVERABLE]
)
def test_rollback_at_any_phase_restores_the_drafts_and_the_retry_is_exact(family, phase, error, flag):
    faults = FaultInjector()
    engine, requests, policies = scenario(family, faults=faults)
    before = engine_snapshot(engine)
    faults.arm(phase, error)
    events = list(engine.run(max_events=64))
    assert [(e.request, e.flags) for e in events] == [(None, flag)]
    assert engine_snapshot(engine) == before  # drafts and draft counters included
    retried = keys(run_with(engine, policies))
    clean, _, clean_policies = scenario(family)
    assert retried == keys(run_with(clean, clean_policies))
    assert engine.stats().drafts_accepted == clean.stats().drafts_accepted > 0


FATAL = [
    ("plan", E.ENGINE_CONTRACT_FAILURE),
    ("reserve", E.ENGINE_CONTRACT_FAILURE),
    ("execute", E.ENGINE_EXECUTION_FAILURE),
    ("prepare", E.ENGINE_EXECUTION_FAILURE),
    ("commit_request", E.ENGINE_EXECUTION_FAILURE),
    ("commit_cache", E.ENGINE_EXECUTION_FAILURE),
    ("publish", E.ENGINE_EXECUTION_FAILURE),
]


@pytest.mark.parametrize("phase, code", FATAL, ids=[p for p, _ in FATAL])
def test_fatal_failure_with_drafts_fails_every_affected_turn(family, phase, code):
    faults = FaultInjector()
    engine, requests, _ = scenario(family, faults=faults)
    faults.arm(phase)
    events = drain(engine, 3)
    finished = {e.request.id for e in events if e.flags & F.TURN_FINISHED}
    executable = {"correct", "partly", "sampled", "prefill", "waiting"}
    assert finished == {requests[name].id for name in executable}
    assert all(e.error_code is code for e in events if e.flags & F.TURN_FINISHED)
    assert all(requests[name].draft_tokens == () for name in executable)
    with pytest.raises(pg.EngineError, match="unhealthy"):
        engine.run(max_events=4)
    for request in requests.values():
        request.close()
    assert engine.stats().free_blocks == engine.stats().total_blocks


def _prompt_reaching(condition, eos_free: bool, eos: int) -> list[int]:
    """The first short prompt whose greedy continuation (EOS counted as a token) satisfies ``condition``."""
    for a in range(VOCAB):
        for b in range(VOCAB):
            out = synthetic_greedy([a, b], 10, VOCAB)
            if condition(out) and eos not in out[:2] and a != eos and b != eos:
                return [a, b]
    raise AssertionError("no prompt found")


def test_failed_rollback_with_drafts_is_fatal(family):
    faults = FaultInjector()
    engine, requests, _ = scenario(family, faults=faults)
    faults.arm("execute", RetryableExecutionError("transient"))
    faults.arm("rollback")
    events = drain(engine, 3)
    assert all(e.error_code is E.ENGINE_EXECUTION_FAILURE for e in events if e.flags & F.TURN_FINISHED)
    assert not engine.stats().healthy


def test_a_failure_attributed_to_a_drafting_request_fails_it_alone(family):
    """The sampler names the verification rows' request: only its turn fails; the others keep their
    proposals and commit in the next step exactly as they would have."""
    faults = FaultInjector()
    engine, requests, policies = scenario(family, faults=faults)
    culprit = requests["correct"]
    faults.arm("sample", request_id=culprit.id, attributed=True)
    events = list(engine.run(max_events=64))
    assert [(e.request, e.error_code) for e in events] == [(culprit, E.REQUEST_FAILED)]
    assert culprit.draft_tokens == () and requests["sampled"].draft_tokens
    rest = keys(run_with(engine, policies))
    clean, clean_requests, clean_policies = scenario(family)
    clean_requests["correct"].cancel_turn(clean_requests["correct"].turn_id)
    expected = [k for k in keys(run_with(clean, clean_policies)) if k[0] != clean_requests["correct"].id]
    assert rest == expected
