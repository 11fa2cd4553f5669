"""Constrained decoding (llguidance) on the synthetic model: every guided output matches its grammar.

The synthetic tokenizer spells token t as ``chr(32 + t % 95)`` (EOS 256 is special), so regexes and Lark
grammars over printable ASCII constrain it like a real vocabulary. The model's greedy token is a closed
formula: a mask that lets it through keeps it, one that does not forces another allowed token, so guided
outputs differ from the unguided ones and are checked with ``re.fullmatch`` (or a parser for the Lark
grammar). Unguided requests batched with guided ones emit exactly what they emit alone.
"""

from __future__ import annotations

import re
import threading

import pytest

import pagedgen as pg
from pagedgen.engine.faults import FaultInjector
from pagedgen.errors import InjectedFault, InvalidArgumentError
from tests.helpers import (
    RECOVERABLE,
    RECOVERABLE_IDS,
    VOCAB,
    cursor_state,
    drain,
    engine_snapshot,
    expected_greedy,
    finishes_of,
    make_engine,
    synthetic_model,
    tokens_of,
    turn_options,
)

F = pg.EngineEventFlags
E = pg.EngineErrorCode
R = pg.FinishReason
EOS = 256

EMAIL = r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"
NUMBERS = r"\[[0-9]{1,3}(,[0-9]{1,3}){2,5}\]"
WORDS = r"(cat|dog|bird)( (cat|dog|bird)){3}"
REGEXES = [EMAIL, NUMBERS, WORDS]

# A Lark grammar (rules, terminals, alternatives) and the regular expression of the same language.
LARK = r"""
start: item ("," item)~2 ";"
item: KEY "=" value
value: NUMBER | "[" NUMBER ("|" NUMBER)? "]"
KEY: /[a-z]{2}/
NUMBER: /[0-9]{1,2}/
"""
_ITEM = r"[a-z]{2}=([0-9]{1,2}|\[[0-9]{1,2}(\|[0-9]{1,2})?\])"
LARK_LANGUAGE = rf"{_ITEM}(,{_ITEM}){{2}};"


def model(eos: int | None = EOS) -> pg.Model:
    return synthetic_model(eos_token_id=eos)


def guided(
    engine: pg.Engine,
    prompt: list[int],
    kind: str | None,
    data: str = "",
    max_new: int = 60,
    stop_strings: tuple[str, ...] = (),
    max_session_tokens: int = 0,
    **search,
) -> pg.Request:
    """A request whose params carry ``kind``/``data`` guidance (None: unguided), first turn begun."""
    params = pg.GeneratorParams(engine.model)
    if search:
        params.set_search_options(**search)
    if kind is not None:
        params.set_guidance(kind, data)
    options = pg.RequestOptions()
    options.set_max_session_tokens(max_session_tokens)
    request = engine.create_request(params, options)
    request.begin_turn(prompt, turn_options(request, max_new, stop_strings))
    return request


def text(engine: pg.Engine, tokens: list[int]) -> str:
    return engine.model.tokenizer.decode(tokens)


PROMPTS = [[5, 6, 7], [40, 41], [9, 80, 3, 11], [70]]


# -- outputs match their grammar ---------------------------------------------------------------------


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_regex_outputs_fully_match_in_a_batch_with_unguided_requests(sampled):
    engine = make_engine(model(), block_size=4)
    search = {"do_sample": True, "temperature": 1.5, "seed": 7} if sampled else {}
    guided_requests = {
        guided(engine, prompt, "regex", regex, **search): regex for prompt in PROMPTS[:2] for regex in REGEXES
    }
    free = [guided(engine, prompt, None, max_new=30) for prompt in PROMPTS]
    events = drain(engine)
    tokens, finishes = tokens_of(events), finishes_of(events)
    for request, regex in guided_requests.items():
        out = text(engine, tokens[request])
        assert re.fullmatch(regex, out), (regex, out)
        assert [e.finish_reason for e in finishes[request]] == [R.EOS]
        assert finishes[request][0].usage.generated_tokens == len(tokens[request])
    for request, prompt in zip(free, PROMPTS, strict=True):
        assert tokens[request] == expected_greedy(prompt, 30, VOCAB, EOS)
    assert engine.stats().guided_rows_masked == sum(len(tokens[r]) for r in guided_requests)
    assert engine.stats().rollbacks == 0


def test_guidance_changes_what_the_model_would_emit():
    """The proof that masks are applied at all: the unguided greedy text does not match, the guided does."""
    engine = make_engine(model(), block_size=4)
    free = guided(engine, [5, 6, 7], None, max_new=12)
    request = guided(engine, [5, 6, 7], "regex", EMAIL)
    tokens = tokens_of(drain(engine))
    assert not re.fullmatch(EMAIL, text(engine, tokens[free]))
    assert re.fullmatch(EMAIL, text(engine, tokens[request]))


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_lark_outputs_are_in_the_grammar_language(sampled):
    engine = make_engine(model(), block_size=4)
    search = {"do_sample": True, "temperature": 1.5} if sampled else {}
    requests = [
        guided(engine, prompt, "lark_grammar", LARK, 80, seed=i, **search) for i, prompt in enumerate(PROMPTS)
    ]
    free = guided(engine, [1, 2], None, max_new=25)
    events = drain(engine)
    tokens, finishes = tokens_of(events), finishes_of(events)
    for request in requests:
        assert re.fullmatch(LARK_LANGUAGE, text(engine, tokens[request])), text(engine, tokens[request])
        assert [e.finish_reason for e in finishes[request]] == [R.EOS]
    assert tokens[free] == expected_greedy([1, 2], 25, VOCAB, EOS)


def test_output_alone_equals_output_in_a_batch():
    alone = {}
    for regex in REGEXES:
        engine = make_engine(model(), block_size=4)
        request = guided(engine, [5, 6, 7], "regex", regex, do_sample=True, seed=3)
        alone[regex] = tokens_of(drain(engine))[request]
    engine = make_engine(model(), block_size=4, max_scheduled_tokens=16)
    batch = {guided(engine, [5, 6, 7], "regex", regex, do_sample=True, seed=3): regex for regex in REGEXES}
    guided(engine, list(range(20, 40)), None, max_new=20)  # a long prefill chunked beside them
    tokens = tokens_of(drain(engine))
    assert {regex: tokens[r] for r, regex in batch.items()} == alone


# -- turns, snapshots, refusals ------------------------------------------------------------------------


def run_turn(engine: pg.Engine, request: pg.Request, prompt: list[int], options: pg.TurnOptions | None):
    request.begin_turn(prompt, options)
    events = drain(engine)
    (end,) = finishes_of(events)[request]
    return tokens_of(events)[request], end.finish_reason


def test_a_turn_overrides_or_clears_the_params_guidance():
    engine = make_engine(model(), block_size=4)
    params = pg.GeneratorParams(engine.model)
    params.set_guidance("regex", EMAIL)
    request = engine.create_request(params)
    first, end = run_turn(engine, request, [5, 6, 7], turn_options(request, 60))  # the params' grammar
    assert re.fullmatch(EMAIL, text(engine, first)) and end is R.EOS
    override = turn_options(request, 60)
    override.set_guidance("regex", WORDS)
    second, end = run_turn(engine, request, [8], override)
    assert re.fullmatch(WORDS, text(engine, second)) and end is R.EOS
    clear = turn_options(request, 15)
    clear.set_guidance(None)
    history = list(request.tokens) + [9]
    third, end = run_turn(engine, request, [9], clear)  # unconstrained: the model's own greedy tokens
    assert third == expected_greedy(history, 15, VOCAB, EOS) and end is R.MAX_GENERATED_TOKENS
    fourth, end = run_turn(engine, request, [10], turn_options(request, 60))  # back to the params'
    assert re.fullmatch(EMAIL, text(engine, fourth)) and end is R.EOS


def test_the_request_snapshots_the_params_guidance_at_create_request():
    engine = make_engine(model(), block_size=4)
    params = pg.GeneratorParams(engine.model)
    params.set_guidance("regex", EMAIL)
    request = engine.create_request(params)
    params.set_guidance("regex", WORDS)  # later edits do not reach the request
    out, _ = run_turn(engine, request, [5, 6, 7], turn_options(request, 60))
    assert re.fullmatch(EMAIL, text(engine, out))
    params.set_guidance(None)
    out, _ = run_turn(engine, request, [5], turn_options(request, 60))
    assert re.fullmatch(EMAIL, text(engine, out))


# Compiles on its own, fails against the synthetic tokenizer (token 999 does not exist).
BAD_FOR_TOKENIZER = "start: <[999]>"


@pytest.mark.parametrize(
    "kind, data, match",
    [
        ("regex", "[a-z", "regex"),
        ("json_schema", '{"type": "nonsense"}', "json_schema"),
        ("lark_grammar", BAD_FOR_TOKENIZER, "tokenizer: .*999"),
        ("xml", "<a/>", "kind"),
    ],
)
def test_set_guidance_refuses_and_keeps_the_params(kind, data, match):
    engine = make_engine(model())
    params = pg.GeneratorParams(engine.model)
    params.set_guidance("regex", EMAIL)
    before = params.guidance
    with pytest.raises(InvalidArgumentError, match=match) as raised:
        params.set_guidance(kind, data)
    assert raised.value.field == "guidance" and params.guidance is before


def test_begin_turn_refuses_a_turn_grammar_that_fails_for_the_tokenizer_and_changes_nothing():
    engine = make_engine(model(), block_size=4)
    request = guided(engine, [5, 6, 7], "regex", EMAIL)
    drain(engine)
    options = pg.TurnOptions()  # not bound to a request: only begin_turn knows the model
    options.set_guidance("lark_grammar", BAD_FOR_TOKENIZER)
    before = engine_snapshot(engine)
    with pytest.raises(InvalidArgumentError, match="999") as raised:
        request.begin_turn([1, 2], options)
    assert raised.value.field == "guidance"
    assert engine_snapshot(engine) == before and request.turn_id == 1
    assert request.status is pg.RequestStatus.TURN_COMPLETE
    out, end = run_turn(engine, request, [1, 2], turn_options(request, 60))  # the request still works
    assert re.fullmatch(EMAIL, text(engine, out)) and end is R.EOS


# -- how guided turns end --------------------------------------------------------------------------------


def test_a_grammar_that_forbids_eos_ends_at_the_token_limit_with_a_prefix():
    engine = make_engine(model(), block_size=4)
    request = guided(engine, [5, 6, 7], "regex", r"[a-z]{20}x", max_new=6)
    events = drain(engine)
    out = text(engine, tokens_of(events)[request])
    (end,) = finishes_of(events)[request]
    assert end.finish_reason is R.MAX_GENERATED_TOKENS and end.usage.generated_tokens == 6
    assert re.fullmatch(r"[a-z]{6}", out)  # an incomplete prefix of the grammar's language


def test_a_complete_grammar_ends_the_turn_even_with_ignore_eos():
    """``ignore_eos`` cannot run a guided turn past its grammar: once complete it ends with EOS."""
    engine = make_engine(model(), block_size=4)
    request = guided(engine, [5, 6, 7], "regex", EMAIL, ignore_eos=True)
    events = drain(engine)
    assert re.fullmatch(EMAIL, text(engine, tokens_of(events)[request]))
    assert [e.finish_reason for e in finishes_of(events)[request]] == [R.EOS]


def test_with_ignore_eos_an_eos_token_is_output_and_completes_the_grammar():
    """``[a-z]+`` accepts after one letter but never completes on its own; a biased EOS is then sampled,
    emitted as an ordinary token (``ignore_eos``), and consuming it completes the grammar."""
    engine = make_engine(model(), block_size=4)
    request = guided(engine, [5, 6, 7], "regex", r"[a-z]+", ignore_eos=True, logit_bias={EOS: 50.0})
    events = drain(engine)
    out = tokens_of(events)[request]
    assert len(out) == 2 and re.fullmatch(r"[a-z]", text(engine, out[:1])) and out[1] == EOS
    assert [e.finish_reason for e in finishes_of(events)[request]] == [R.EOS]


def test_completion_ends_the_turn_below_a_minimum_length():
    """``min_new_tokens`` suppresses EOS, but a complete grammar allows nothing else: the turn ends."""
    engine = make_engine(model(), block_size=4)
    request = guided(engine, [5, 6, 7], "regex", EMAIL, min_new_tokens=40)
    events = drain(engine)
    assert re.fullmatch(EMAIL, text(engine, tokens_of(events)[request]))
    assert [e.finish_reason for e in finishes_of(events)[request]] == [R.EOS]


def test_completion_at_the_token_limit_is_reported_as_eos():
    engine = make_engine(model(), block_size=4)
    reference = guided(engine, [5, 6, 7], "regex", EMAIL)
    length = len(tokens_of(drain(engine))[reference])
    engine = make_engine(model(), block_size=4)
    request = guided(engine, [5, 6, 7], "regex", EMAIL, max_new=length)
    events = drain(engine)
    assert len(tokens_of(events)[request]) == length
    assert [e.finish_reason for e in finishes_of(events)[request]] == [R.EOS]


def test_a_model_without_eos_ends_at_the_grammar_or_the_limit():
    engine = make_engine(model(eos=None), block_size=4)
    complete = guided(engine, [5, 6, 7], "regex", EMAIL)
    open_ended = guided(engine, [5, 6, 7], "regex", r"[a-z]+", max_new=9)
    events = drain(engine)
    tokens, finishes = tokens_of(events), finishes_of(events)
    assert (
        re.fullmatch(EMAIL, text(engine, tokens[complete])) and finishes[complete][0].finish_reason is R.EOS
    )
    assert re.fullmatch(r"[a-z]{9}", text(engine, tokens[open_ended]))
    assert finishes[open_ended][0].finish_reason is R.MAX_GENERATED_TOKENS


def test_stop_strings_end_a_guided_turn_first():
    engine = make_engine(model(), block_size=4)
    reference = guided(engine, [5, 6, 7], "regex", EMAIL)
    out = text(engine, tokens_of(drain(engine))[reference])
    stop = out[out.index("@") : out.index("@") + 2]
    engine = make_engine(model(), block_size=4)
    request = guided(engine, [5, 6, 7], "regex", EMAIL, stop_strings=(stop,))
    events = drain(engine)
    (end,) = finishes_of(events)[request]
    assert end.finish_reason is R.STOP_SEQUENCE
    assert text(engine, tokens_of(events)[request]) == out[: out.index("@")]


def test_cancel_and_close_release_the_cursor():
    engine = make_engine(model(), block_size=4)
    cancelled = guided(engine, [5, 6, 7], "regex", EMAIL)
    closed = guided(engine, [8, 9], "regex", EMAIL)
    finished = guided(engine, [1, 2], "regex", WORDS)
    engine.run(max_events=64)
    assert all(r._state.cursor is not None for r in (cancelled, closed, finished))
    assert cancelled.cancel_turn(1)
    assert cancelled._state.cursor is None
    state = closed._state
    closed.close()
    assert state.cursor is None
    drain(engine)
    assert finished._state.cursor is None and finished.status is pg.RequestStatus.TURN_COMPLETE


# -- failures ---------------------------------------------------------------------------------------------


def scenario(faults: FaultInjector | None = None) -> tuple[pg.Engine, dict[str, pg.Request]]:
    """Guided greedy, guided sampled with a stop string, an unguided decode, and a guided chunked prefill
    (masked only at its last chunk): every kind of guided state a step touches (``faults``: the engine's
    injector)."""
    engine = make_engine(model(), block_size=4, num_blocks=64, max_scheduled_tokens=12, faults=faults)
    requests = {
        "greedy": guided(engine, [5, 6, 7], "regex", EMAIL),
        "sampled": guided(
            engine, [40, 41], "regex", NUMBERS, stop_strings=("]]",), do_sample=True, temperature=1.5, seed=5
        ),
        "free": guided(engine, [9, 8], None, max_new=20),
    }
    run_steps(engine, 2)
    requests["prefill"] = guided(engine, list(range(30, 50)), "lark_grammar", LARK)
    run_steps(engine, 1)
    assert requests["prefill"].status is pg.RequestStatus.ACTIVE
    assert 0 < requests["prefill"].processed_length < 20
    return engine, requests


def run_steps(engine: pg.Engine, steps: int) -> None:
    for _ in range(steps):
        engine.run(max_events=64)
        while engine.stats().pending_events:
            engine.run(max_events=64)


def scenario_outputs(events) -> dict[str, tuple]:
    tokens, finishes = tokens_of(events), finishes_of(events)
    return {r: (tuple(tokens[r]), tuple(e.finish_reason for e in finishes[r])) for r in tokens | finishes}


def reference_run() -> dict[int, tuple]:
    engine, requests = scenario()
    events = drain(engine)
    return {r.id: out for r, out in scenario_outputs(events).items()}


@pytest.mark.parametrize("phase, error", RECOVERABLE, ids=RECOVERABLE_IDS)
@pytest.mark.parametrize("at_step", [0, 2, 5])
def test_a_rolled_back_step_restores_every_cursor_exactly(phase, error, at_step):
    faults = FaultInjector()
    engine, requests = scenario(faults=faults)
    run_steps(engine, at_step)
    before = engine_snapshot(engine)  # holds each cursor's consumed count, next mask and completeness
    cursors = {name: cursor_state(r._state.cursor) for name, r in requests.items()}
    faults.arm(phase, error)
    (event,) = engine.run(max_events=64)
    assert event.request is None and event.flags & (F.RETRYABLE | F.CAPACITY_BLOCKED)
    assert engine_snapshot(engine) == before
    assert {name: cursor_state(r._state.cursor) for name, r in requests.items()} == cursors
    # The retry continues exactly as a fault-free run.
    after = {r.id: out for r, out in scenario_outputs(drain(engine)).items()}
    fault_free, _ = scenario()
    run_steps(fault_free, at_step)
    assert after == {r.id: out for r, out in scenario_outputs(drain(fault_free)).items()}


@pytest.mark.parametrize("phase", ["sample", "stage"])
def test_a_fault_attributed_to_a_guided_request_fails_only_its_turn(phase):
    faults = FaultInjector()
    engine, requests = scenario(faults=faults)
    reference = reference_run()
    victim = requests["greedy"]
    faults.arm(phase, InjectedFault("its own"), request_id=victim.id, attributed=True)
    events = drain(engine)
    (end,) = finishes_of(events)[victim]
    assert end.flags & F.FAILED and end.error_code is E.REQUEST_FAILED
    assert victim._state.cursor is None and engine.stats().healthy
    outputs = {r.id: out for r, out in scenario_outputs(events).items()}
    for name in ("sampled", "free", "prefill"):
        rid = requests[name].id
        done = reference[rid][0][: len(reference[rid][0]) - len(outputs[rid][0])]
        assert done + outputs[rid][0] == reference[rid][0] and outputs[rid][1] == reference[rid][1]


FATAL = ["plan", "reserve", "prepare", "commit_request", "commit_cache", "publish"]


@pytest.mark.parametrize("phase", FATAL)
def test_a_fail_stop_step_fails_every_guided_turn_and_releases_its_cursor(phase):
    faults = FaultInjector()
    engine, requests = scenario(faults=faults)
    faults.arm(phase)
    events = []
    while engine.has_pending_requests():
        events += engine.run(max_events=64)
    assert not engine.stats().healthy
    for request in requests.values():
        assert request._state.cursor is None
    failed = {e.request for e in events if e.flags & F.FAILED}
    assert failed == {requests[n] for n in ("greedy", "sampled", "free", "prefill")}


def test_an_llguidance_error_mid_generation_fails_only_that_turn():
    """A matcher llguidance puts in its error state (here: fed a token its grammar rejects, behind the
    engine's back) is found by the next mask computation: that turn fails, the others are untouched."""
    engine, requests = scenario()
    reference = reference_run()
    victim = requests["greedy"]
    victim._state.cursor._matcher.consume_token(0)  # " " is never part of an email address
    events = drain(engine)
    (end,) = finishes_of(events)[victim]
    assert end.flags & F.FAILED and end.error_code is E.GUIDANCE_FAILED and end.finish_reason is R.FAILED
    assert engine.stats().healthy and victim._state.cursor is None
    outputs = {r.id: out for r, out in scenario_outputs(events).items()}
    for name in ("sampled", "free", "prefill"):
        rid = requests[name].id
        assert outputs[rid][1] == reference[rid][1]
        assert reference[rid][0][-len(outputs[rid][0]) :] == outputs[rid][0]
    # The request can start a new (unguided) turn after its failed one.
    clear = turn_options(victim, 3)
    clear.set_guidance(None)
    out, reason = run_turn(engine, victim, [1], clear)
    assert len(out) == 3 and reason is R.MAX_GENERATED_TOKENS


def test_a_token_the_grammar_rejects_at_staging_fails_only_that_turn(monkeypatch):
    """Without its mask (patched away) the greedy token breaks the grammar: consuming it poisons the
    cursor and fails the turn, and the unguided request in the same steps emits its exact tokens."""
    monkeypatch.setattr("pagedgen.sampling.sampler.apply_token_bitmask_", lambda logits, masks: None)
    engine = make_engine(model(), block_size=4)
    victim = guided(engine, [5, 6, 7], "regex", EMAIL)
    free = guided(engine, [9, 8], None, max_new=20)
    events = drain(engine)
    (end,) = finishes_of(events)[victim]
    assert end.error_code is E.GUIDANCE_FAILED and tokens_of(events)[victim] == []
    assert tokens_of(events)[free] == expected_greedy([9, 8], 20, VOCAB, EOS)
    assert engine.stats().healthy


def test_an_llguidance_error_on_the_static_path_fails_only_that_turn():
    engine = make_engine(model(), block_size=4, dynamic_batching=False)
    victim = guided(engine, [5, 6, 7], "regex", EMAIL, max_session_tokens=64)
    other = guided(engine, [8, 9], "regex", WORDS, max_session_tokens=64)
    free = guided(engine, [9, 8], None, max_new=20, max_session_tokens=64)
    events = list(engine.run(max_events=64))  # the first step: every row emits its first token
    victim._state.cursor._matcher.consume_token(0)
    events += drain(engine)
    (end,) = finishes_of(events)[victim]
    assert end.error_code is E.GUIDANCE_FAILED and engine.stats().healthy
    assert re.fullmatch(WORDS, text(engine, tokens_of(events)[other]))
    assert [e.finish_reason for e in finishes_of(events)[other]] == [R.EOS]
    assert tokens_of(events)[free] == expected_greedy([9, 8], 20, VOCAB, EOS)


# -- drafts, static path, stats ---------------------------------------------------------------------------


def guided_reference(regex: str, prompt: list[int], **search) -> list[int]:
    engine = make_engine(model(), block_size=4)
    request = guided(engine, prompt, "regex", regex, **search)
    return tokens_of(drain(engine))[request]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("drafts", ["correct", "wrong", "partly", "off-grammar"])
def test_drafts_with_guidance_emit_exactly_the_draft_free_tokens(sampled, drafts):
    search = {"do_sample": True, "temperature": 1.5, "seed": 9} if sampled else {}
    prompts = {EMAIL: [5, 6, 7], NUMBERS: [40, 41]}
    truth = {regex: guided_reference(regex, prompt, **search) for regex, prompt in prompts.items()}
    engine = make_engine(model(), block_size=4)
    requests = {guided(engine, prompt, "regex", regex, **search): regex for regex, prompt in prompts.items()}
    free = guided(engine, [9, 8], None, max_new=20)
    undrafted = guided(engine, [70], "regex", WORDS, **search)  # guided rows with and without drafts mix

    def proposal(request: pg.Request) -> list[int]:
        done = request._state.turn_generated_tokens
        right = truth[requests[request]][done : done + 4]
        if drafts == "correct":
            return right
        if drafts == "wrong":
            return [(t + 1) % EOS for t in right]
        if drafts == "partly":
            return right[:2] + [(t + 1) % EOS for t in right[2:]]
        return [0, 0, 0]  # spaces: no grammar here allows one

    buffer = engine.create_event_buffer(64)
    events = []
    while engine.has_pending_requests():
        for request in requests:
            if request.ready_for_drafts:
                request.set_draft_tokens(proposal(request))
        events += engine.run(buffer)
    tokens = tokens_of(events)
    assert {requests[r]: tokens[r] for r in requests} == truth
    assert tokens[free] == expected_greedy([9, 8], 20, VOCAB, EOS)
    assert tokens[undrafted] == guided_reference(WORDS, [70], **search)
    stats = engine.stats()
    assert stats.rollbacks == 0  # (failure isolation would hide a failing mask batch behind exact outputs)
    assert stats.drafts_proposed > 0
    assert (stats.drafts_accepted > 0) == (drafts in ("correct", "partly"))


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_the_static_path_applies_masks_too(sampled):
    search = {"do_sample": True, "temperature": 1.5, "seed": 4} if sampled else {}
    outputs = {}
    for dynamic in (True, False):
        engine = make_engine(model(), block_size=4, dynamic_batching=dynamic)
        session = 128  # the static path allocates each row's whole session up front
        requests = {
            guided(engine, [5, 6, 7], "regex", r, max_session_tokens=session, **search): r for r in REGEXES
        }
        free = guided(engine, [9, 8], None, max_new=20, max_session_tokens=session)
        tokens = tokens_of(drain(engine))
        for request, regex in requests.items():
            assert re.fullmatch(regex, text(engine, tokens[request]))
        assert tokens[free] == expected_greedy([9, 8], 20, VOCAB, EOS)
        outputs[dynamic] = {regex: tokens[r] for r, regex in requests.items()}
        assert engine.stats().guided_rows_masked == sum(len(tokens[r]) for r in requests)
    assert outputs[True] == outputs[False]


def test_mask_statistics_count_rows_and_time():
    engine = make_engine(model(), block_size=4)
    assert engine.stats().guided_rows_masked == 0 and engine.stats().mask_seconds == 0.0
    request = guided(engine, [5, 6, 7], "regex", EMAIL)
    tokens = tokens_of(drain(engine))[request]
    stats = engine.stats()
    assert stats.guided_rows_masked == len(tokens)  # one mask per emitted token: completion needs no EOS step
    assert stats.mask_seconds > 0.0 and stats.mask_wait_seconds >= 0.0


# -- a mask past its step budget ---------------------------------------------------------------------------


def slow_mask_run(at_step: int, hold: bool) -> tuple[pg.Engine, dict[str, pg.Request], list[pg.EngineEvent]]:
    """Three guided requests and an unguided one; with ``hold``, the "slow" request's masks wait for a gate
    that is opened only after the run (its mask is never ready in time) from step ``at_step`` on."""
    faults = FaultInjector()
    engine = make_engine(model(), block_size=4, mask_budget_s=0.2, faults=faults)
    requests = {
        "slow": guided(engine, [5, 6, 7], "regex", EMAIL),
        "words": guided(engine, [40, 41], "regex", WORDS),
        "sampled": guided(engine, [9, 80], "regex", NUMBERS, do_sample=True, temperature=1.5, seed=3),
        "free": guided(engine, [9, 8], None, max_new=20),
    }
    events = []
    for _ in range(at_step):
        events += engine.run(max_events=64)
    gate = threading.Event()
    if hold:
        faults.hold_masks(requests["slow"].id, gate)
    try:
        events += drain(engine)
    finally:
        gate.set()
    return engine, requests, events


@pytest.mark.parametrize("at_step", [0, 3])
def test_a_mask_past_its_step_budget_fails_that_turn_alone_and_the_batch_steps_on(at_step):
    engine, requests, events = slow_mask_run(at_step, hold=True)
    _, reference, reference_events = slow_mask_run(at_step, hold=False)
    tokens, finishes = tokens_of(events), finishes_of(events)
    solo_tokens, solo_finishes = tokens_of(reference_events), finishes_of(reference_events)
    slow = requests["slow"]
    (end,) = finishes[slow]
    assert end.flags & F.FAILED and end.finish_reason is R.FAILED and end.error_code is E.GUIDANCE_FAILED
    assert end.error_message == (
        "guidance failed: the constraint's token mask was not ready within the step budget of 0.2 s"
    )
    assert tokens[slow] == solo_tokens[reference["slow"]][:at_step]  # what it had before, nothing after
    for name in ("words", "sampled", "free"):  # batch-mates emit exactly what they emit without it
        assert tokens[requests[name]] == solo_tokens[reference[name]]
        assert [e.finish_reason for e in finishes[requests[name]]] == [
            e.finish_reason for e in solo_finishes[reference[name]]
        ]
    stats = engine.stats()
    assert stats.healthy and stats.rollbacks == 1  # one rolled-back step for the slow row, no loop
    assert engine.parts.step.masker.abandoned_pools == 1 and slow._state.cursor is None
    for request in requests.values():
        request.close()
    drain(engine)
    assert engine.stats().free_blocks == engine.stats().total_blocks
