"""A hypothesis state machine over the public engine API on the synthetic model.

Random sequences of create / begin_turn / run (capacities 0, 1, 2, 16) / cancel / close / drop / injected
retryable faults, against a small cache (deferrals, chunked and mixed steps happen often). After every
operation the engine's cache and request invariants hold; every emitted token is exactly the synthetic
model's greedy continuation of the request's logical sequence; every turn ends with exactly one terminal
event whose reason matches the limits; refused calls change nothing; at the end every block is free.

A third of the machines run the windowed synthetic model (a sliding-window layer, window 2..9, kept in rings
of the window pool with chunk cap 5), so the exact-token check covers ring slots across every wrap, rollback
and release too. Half run the hybrid synthetic model, whose tokens also depend on a fixed conv state that
every token changes (kept in the fixed-state pool's two banks): a lost, doubled or leaked state update, a
state not carried from one prefill chunk to the next, or a slot reused without being reset changes the tokens.

Half the machines have a pool of 5 blocks with sessions capped at 20 tokens (every request fits alone, two
often do not): residents that cannot grow preempt younger ones, which are re-prefilled, and idle residents
yield to waiting work; the exact-token and one-terminal-event checks prove nothing is lost or repeated.

Prefix caching is on (the default) in the machines whose model allows it (the windowed and hybrid ones switch
it off, so they cover the engine without it); rules begin new requests with a prefix of another request's
sequence or of a fixed stem, so admissions start from shared cached blocks and the small pool evicts them,
and the exact-token check proves every hit held exactly the request's own prefix. A rolled-back step is exact
except for cached blocks it evicted after its model may have run (they come back FREE and unnamed,
docs/cache.md). Every terminal event's ``cached_prompt_tokens`` lies within its ``prompt_tokens`` (0 with
caching off).

Speculative drafts are a rule too: correct, wrong or partly correct proposals (from the request's committed
sequence), clears, and refused proposals (too many, out of the vocabulary, wrong state, or any proposal on the
hybrid model, which cannot verify drafts). The exact-token check is unchanged: drafts never change output,
with prefix caching on (a block published at commit holds only accepted tokens) and across preemption (a
preempted request's pending drafts are dropped).

Turns may be guided (a regex set on the turn's options; chars are ``chr(32 + t)``): their exact tokens are the
synthetic greedy choice under llguidance's mask (the formula's token if allowed, else its bumped neighbour,
else the lowest allowed id), a turn ends by EOS when its grammar is complete or the masked choice is EOS, and
the snapshot a rolled-back step must restore holds each grammar cursor's position and next mask. The drafts
proposed for a guided turn are its guided continuation (correct, wrong or partly so, as for any turn).

Faults are transient (each clears after one step), so a rolled-back step changes nothing else, except that
failure isolation may fail one turn (REQUEST_FAILED) once MAX_RETRIES steps in a row have rolled back without
a commit between them: the machine counts those from the engine's stats and allows exactly that.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import event as note
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, rule

import pagedgen as pg
from pagedgen.engine.faults import FaultInjector
from pagedgen.engine.parts import build_engine_parts
from pagedgen.errors import RetryableExecutionError
from pagedgen.guidance import compile_guidance
from pagedgen.guidance.cursor import GrammarCursor
from pagedgen.models.synthetic import SyntheticModel, synthetic_greedy
from tests.helpers import after_rollback, engine_snapshot, spy_evictions

VOCAB = 31
EOS = 5
STEMS = ([1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22, 23, 24, 25, 26, 27] * 2)
MAX_RETRIES = 2  # small, so that isolation happens in the random sequences too
# Grammars over the 31-token vocabulary ("0"-"9" are ids 16-25, ":" 26, ";" 27): one that completes, one that
# accepts from its second token on and never completes (EOS may end it).
GRAMMARS = (r"[0-9]{2}:[0-9;]{1,3}=", r"[0-9][0-9;]+")
F = pg.EngineEventFlags
R = pg.FinishReason


@dataclass
class Expected:
    """What the test knows about one request, derived only from its own calls and the events it saw."""

    handle: pg.Request | None
    session: int
    seq: list[int] = field(default_factory=list)  # committed logical sequence at the start of the turn
    turn_id: int = 0
    max_new: int = 0
    emitted: list[int] = field(default_factory=list)
    greedy: list[int] = field(default_factory=list)  # the turn's exact greedy continuation
    ends_by_eos: bool = True  # the greedy continuation stops by EOS (or a complete grammar) before its cap
    guided: bool = False  # the turn has a grammar
    open: bool = False  # a turn began and its terminal event was not received yet
    closed: bool = False
    dropped: bool = False


class EngineMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    @initialize(
        window=st.none() | st.none() | st.integers(2, 9),
        hybrid=st.booleans(),
        num_blocks=st.sampled_from([12, 5]),
    )
    def start(self, window, hybrid, num_blocks):
        self.hybrid = hybrid
        self.model = SyntheticModel(vocab_size=VOCAB, eos_token_id=EOS, window=window, hybrid=hybrid)
        self.evicted: set[int] = set()
        config = pg.EngineConfig(
            max_batch_size=2,
            max_scheduled_tokens=8,
            chunk_size=5,
            block_size=4,
            # 12: a 40-token session needs 10, so two requests often cannot grow together; 5: sessions are
            # capped at 20 tokens (5 blocks), so every request fits alone and preemption is common.
            num_blocks=num_blocks,
            debug_invariants=True,
            max_step_retries=MAX_RETRIES,
        )
        self.faults = FaultInjector()
        parts = build_engine_parts(
            self.model, config, faults=self.faults, wrap_cache=spy_evictions(self.evicted)
        )
        self.engine = pg.Engine(self.model, config, parts=parts)
        self.caching = self.engine.stats().prefix_caching
        self.max_session = min(40, num_blocks * 4)
        self.expected: dict[int, Expected] = {}
        self.next_key = 0
        self.steps = 0  # committed steps seen so far
        self.rollbacks_at_commit = 0  # the engine's rollback count when the last commit was seen

    # -- operations -----------------------------------------------------------------------------------

    @rule(target=requests, session=st.integers(4, 40))
    def create(self, session):
        session = min(session, self.max_session)  # never unserviceable
        options = pg.RequestOptions()
        options.set_max_session_tokens(session)
        handle = self.engine.create_request(pg.GeneratorParams(self.model), options)
        self.expected[handle.id] = Expected(handle, session)
        return handle.id

    @rule(
        rid=requests,
        tokens=st.lists(st.integers(0, VOCAB - 1), max_size=12),
        max_new=st.integers(0, 6),
        grammar=st.sampled_from([None, None, *GRAMMARS]),
    )
    def begin_turn(self, rid, tokens, max_new, grammar=None):
        exp = self.expected[rid]
        if exp.handle is None:
            return
        options = pg.TurnOptions(exp.handle)
        options.set_max_generated_tokens(max_new)
        if grammar is not None:
            options.set_guidance("regex", grammar)
        legal = not exp.closed and not exp.open and tokens and len(exp.seq) + len(tokens) < exp.session
        if not legal:
            self.assert_refused(lambda: exp.handle.begin_turn(tokens, options))
            return
        assert exp.handle.begin_turn(tokens, options) == exp.turn_id + 1
        exp.turn_id += 1
        exp.seq += tokens
        exp.max_new = max_new
        exp.emitted = []
        cap = min(max_new or exp.session - len(exp.seq), exp.session - len(exp.seq))
        exp.guided = grammar is not None
        if exp.guided:
            exp.greedy, exp.ends_by_eos = self.guided_greedy(exp.seq, cap, grammar)
            note("guided turn")
        else:
            exp.greedy = synthetic_greedy(exp.seq, cap, VOCAB, EOS, self.hybrid)
            exp.ends_by_eos = synthetic_greedy(exp.seq + exp.greedy, 1, VOCAB, EOS, self.hybrid) == []
        exp.open = True

    def guided_greedy(self, seq: list[int], cap: int, grammar: str) -> tuple[list[int], bool]:
        """The synthetic greedy continuation under the grammar's masks, and whether it ends by EOS or a
        complete grammar (rather than at ``cap``)."""
        cursor = GrammarCursor.for_model(self.model, compile_guidance("regex", grammar))
        out: list[int] = []
        while len(out) < cap:
            nxt = synthetic_greedy(seq + out, 1, VOCAB, None, self.hybrid)[0]
            mask = int.from_bytes(cursor.allowed_bitmask(), "little")
            allowed = [t for t in range(VOCAB) if mask >> t & 1]
            token = next(t for t in (nxt, (nxt + 1) % VOCAB, *allowed) if t in allowed)
            if token == EOS:
                return out, True
            out.append(token)
            cursor.consume(token)
            if cursor.complete:
                return out, True
        return out, False

    @rule(capacity=st.sampled_from([0, 1, 2, 16]), calls=st.integers(1, 12))
    def run(self, capacity, calls=1):
        for _ in range(calls):
            events = list(self.engine.run(max_events=capacity))
            assert len(events) <= capacity
            for event in events:
                self.observe(event)
            del events  # drop our references to the events (and to any dropped request they name)
            assert self.engine.check_invariants() == []
            self.note_commits()

    def note_commits(self) -> None:
        stats = self.engine.stats()
        if stats.steps != self.steps:
            self.steps, self.rollbacks_at_commit = stats.steps, stats.rollbacks

    @rule(
        target=requests,
        session=st.integers(4, 40),
        tokens=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
        max_new=st.integers(0, 6),
    )
    def create_and_begin(self, session, tokens, max_new):
        rid = self.create(session)
        self.begin_turn(rid, tokens, max_new)
        return rid

    @rule(
        target=requests,
        source=requests,
        cut=st.integers(1, 40),
        tail=st.lists(st.integers(0, VOCAB - 1), max_size=4),
        max_new=st.integers(0, 6),
    )
    def create_sharing(self, source, cut, tail, max_new):
        """A new request whose prompt starts with (a prefix of) another request's committed sequence."""
        exp = self.expected[source]
        done = exp.handle.processed_length if exp.handle is not None and not exp.closed else len(exp.seq)
        tokens = exp.seq[: min(cut, max(done, 1))] + tail  # mostly what the cache already holds
        if not tokens:
            tokens = [1]
        rid = self.create(40)
        self.begin_turn(rid, tokens, max_new)
        return rid

    @rule(target=requests, stem=st.sampled_from(STEMS), cut=st.integers(5, 16), max_new=st.integers(2, 6))
    def create_long(self, stem, cut, max_new):
        """A long prompt from one of two stems: shared prefixes, and pools too small for two at once."""
        rid = self.create(40)
        self.begin_turn(rid, stem[:cut], max_new)
        return rid

    @rule(
        target=requests,
        stem=st.sampled_from(STEMS),
        cuts=st.tuples(st.integers(5, 16), st.integers(5, 16)),
        calls=st.integers(1, 12),
    )
    def share_after_run(self, stem, cuts, calls):
        """A long prompt, some steps, then another request on the same stem (a likely prefix hit)."""
        self.create_long(stem, cuts[0], 3)
        self.run(16, calls)
        return self.create_long(stem, cuts[1], 3)

    @rule(rid=requests, offset=st.integers(-1, 1))
    def cancel(self, rid, offset):
        exp = self.expected[rid]
        if exp.handle is None:
            return
        if exp.closed or exp.turn_id == 0:
            self.assert_refused(lambda: exp.handle.cancel_turn(exp.turn_id + offset))
            return
        executable = exp.handle.status.executable
        assert exp.handle.cancel_turn(exp.turn_id + offset) is (offset == 0 and executable)

    @rule(rid=requests)
    def close(self, rid):
        exp = self.expected[rid]
        if exp.handle is None:
            return
        exp.handle.close()
        exp.closed = True
        exp.open = False
        assert exp.handle.status is pg.RequestStatus.CLOSED and rid not in self.engine.snapshot()["requests"]

    @rule(rid=requests)
    def drop(self, rid):
        exp = self.expected[rid]
        exp.handle = None  # our last reference (retained events may still hold it until drained)
        exp.dropped = True

    @rule(
        rid=requests,
        kind=st.sampled_from(["correct", "wrong", "partly", "clear", "too_many", "out_of_vocab"]),
        k=st.integers(1, 4),
    )
    def propose(self, rid, kind, k):
        exp = self.expected[rid]
        handle = exp.handle
        if handle is None:
            return
        if kind == "clear":
            if exp.closed:
                self.assert_refused(lambda: handle.set_draft_tokens([]))
            else:
                handle.set_draft_tokens([])
                assert handle.draft_tokens == ()
            return
        drafts = self.drafts_for(handle, kind, k)
        legal = self.decoding(exp) and 0 < len(drafts) <= self.engine.max_draft_tokens_per_proposal()
        if not legal or kind == "out_of_vocab":
            self.assert_refused(lambda: handle.set_draft_tokens(drafts))
            return
        handle.set_draft_tokens(drafts)
        assert handle.draft_tokens == tuple(drafts)
        note(f"drafts {kind}")

    @rule(kind=st.sampled_from(["correct", "wrong", "partly"]), k=st.integers(1, 4), calls=st.integers(1, 6))
    def run_with_drafts(self, kind, k, calls):
        """Propose for every decoding request before each run (what a proposer above the engine does)."""
        for _ in range(calls):
            for exp in self.expected.values():
                if exp.handle is not None and self.decoding(exp) and self.hybrid is False:
                    exp.handle.set_draft_tokens(self.drafts_for(exp.handle, kind, k))
                    note(f"drafts {kind} before a run")
            self.run(16, 1)

    def decoding(self, exp: Expected) -> bool:
        """ACTIVE with one token to process, and this turn generated already (judged from the handle)."""
        handle = exp.handle
        return (
            not exp.closed
            and handle.status is pg.RequestStatus.ACTIVE
            and handle.processed_length == handle.sequence_length - 1
            and handle.sequence_length > len(exp.seq)
        )

    def drafts_for(self, handle: pg.Request, kind: str, k: int) -> list[int]:
        seq = list(handle.tokens)
        truth = synthetic_greedy(seq, k, VOCAB, None, self.hybrid) if seq else [0] * k
        exp = self.expected[handle.id]
        if exp.guided and exp.open:  # the guided continuation where it is known, the formula's after it
            done = len(seq) - len(exp.seq)
            truth = (exp.greedy[done : done + k] + truth)[:k] if done >= 0 else truth
        wrong = [(t + 1) % VOCAB for t in truth]
        return {
            "correct": truth,
            "wrong": wrong,
            "partly": truth[:1] + wrong[1:],
            "too_many": truth + [0] * self.engine.max_draft_tokens_per_proposal(),
            "out_of_vocab": [VOCAB],
        }[kind]

    @rule(phase=st.sampled_from(["checkpoint", "pack", "execute", "sample", "stage", "validate"]))
    def retryable_fault(self, phase):
        self.engine.has_pending_requests()  # reclaim first, so the snapshot is what the step starts from
        if self.engine.stats().pending_events:
            return  # run() would drain instead of executing
        before = engine_snapshot(self.engine)
        # No local name for the error: its traceback reaches this frame, whose events may name a dropped
        # request (a failed turn), and that cycle would keep the handle alive until a garbage collection.
        self.evicted.clear()
        self.faults.arm(phase, RetryableExecutionError("transient") if phase == "execute" else None)
        events = list(self.engine.run(max_events=16))
        self.faults.disarm()
        if events and events[0].flags & F.RETRYABLE:
            assert (events[0].request, events[0].error_code) == (None, pg.EngineErrorCode.RETRYABLE_EXECUTION)
            if len(events) == 1:
                # Cached blocks evicted for the step come back intact only if the model never ran.
                lost = set() if phase in ("checkpoint", "pack") else self.evicted
                assert engine_snapshot(self.engine) == after_rollback(before, lost)
                if lost:
                    note("rolled back after evicting cached blocks")
                note("rolled back")
            else:  # isolation found its culprit: only after MAX_RETRIES rollbacks without a commit
                assert self.engine.stats().rollbacks - self.rollbacks_at_commit >= MAX_RETRIES
                assert len(events) == 2 and events[1].error_code is pg.EngineErrorCode.REQUEST_FAILED
                note("isolated")
                self.observe(events[1], isolated=True)
        else:  # no executable step this time (no work, or capacity deferred): the phase was never reached
            for event in events:
                self.observe(event)
        self.note_commits()

    # -- checks ---------------------------------------------------------------------------------------

    def observe(self, event: pg.EngineEvent, isolated: bool = False) -> None:
        """Check one event; ``isolated``: failure isolation just named this request's turn the culprit (the
        only way a turn may fail here)."""
        if event.request is None:
            note("capacity deferred")
            assert (
                event.flags == F.CAPACITY_BLOCKED and event.error_code is pg.EngineErrorCode.CAPACITY_DEFERRED
            )
            return
        exp = self.expected[event.request.id]
        failed = event.error_code is pg.EngineErrorCode.REQUEST_FAILED
        assert event.turn_id == exp.turn_id and bool(event.flags & F.FAILED) is failed
        assert failed is isolated
        if event.flags & F.TOKEN:
            exp.emitted.append(event.token)
            assert exp.emitted == exp.greedy[: len(exp.emitted)]
        if event.flags & F.TURN_FINISHED:
            assert exp.open
            self.check_finish(exp, event)
            exp.open = False
            exp.seq += exp.emitted
            if not exp.dropped:
                assert list(exp.handle.tokens) == exp.seq

    def check_finish(self, exp: Expected, event: pg.EngineEvent) -> None:
        n = len(exp.emitted)
        reason = event.finish_reason
        note(f"finish {reason.name}")
        assert event.usage.generated_tokens == n
        cached = event.usage.cached_prompt_tokens
        assert 0 <= cached <= event.usage.prompt_tokens and (self.caching or cached == 0)
        if cached:
            note("cached prompt tokens")
        if reason is R.MAX_GENERATED_TOKENS:
            assert n == exp.max_new
        elif reason is R.MAX_SESSION_TOKENS:
            assert len(exp.seq) + n == exp.session
        elif reason is R.EOS:
            assert n == len(exp.greedy) and exp.ends_by_eos
        elif reason is R.FAILED:
            assert event.error_code is pg.EngineErrorCode.REQUEST_FAILED
        else:
            assert reason is R.CANCELLED

    def assert_refused(self, call) -> None:
        before = engine_snapshot(self.engine)
        try:
            call()
        except pg.EngineError:
            pass
        else:
            raise AssertionError("call should have been refused")
        assert engine_snapshot(self.engine) == before

    @invariant()
    def consistent(self):
        assert self.engine.check_invariants() == []
        stats = self.engine.stats()
        assert 0 <= stats.drafts_accepted <= stats.drafts_proposed
        assert self.hybrid is (self.engine.max_draft_tokens_per_proposal() == 0)
        for rid, exp in self.expected.items():
            if not exp.closed and not exp.dropped:
                assert rid in self.engine.snapshot()["requests"]
            waiting_or_done = (pg.RequestStatus.ASSIGNED, pg.RequestStatus.TURN_COMPLETE)
            if exp.handle is not None and exp.handle.status in waiting_or_done:
                # pending drafts only ever wait for a decode: a finished turn or a preemption dropped them
                assert exp.handle.draft_tokens == ()

    def teardown(self):
        for exp in self.expected.values():
            if exp.handle is not None:
                exp.handle.close()
                exp.closed, exp.open = True, False
        for _ in range(100):  # events retained for dropped requests still arrive, then they are reclaimed
            if not self.engine.has_pending_requests():
                break
            self.run(16, 1)
        assert not self.engine.has_pending_requests()  # also reclaims the last dropped handles
        assert not self.engine.snapshot()["requests"]
        stats = self.engine.stats()
        assert stats.free_blocks == stats.total_blocks and stats.resident_requests == 0
        assert stats.window_free_blocks == stats.window_total_blocks
        assert stats.fixed_free_slots == stats.fixed_total_slots
        assert self.engine.check_invariants() == []
        self.engine.close()


EngineMachine.TestCase.settings = settings(max_examples=1000, stateful_step_count=30, deadline=None)
test_engine_state_machine = EngineMachine.TestCase


class DraftMachine(EngineMachine):
    """The same machine on models that verify drafts, proposing before every run: drafts in most steps.
    Without a window prefix caching is on, and the 5-block pools preempt often, so drafts meet cache hits,
    blocks published at narrowed commits and preempted requests."""

    @initialize(window=st.none() | st.integers(2, 9), num_blocks=st.sampled_from([12, 5]))
    def start(self, window, num_blocks):
        EngineMachine.start(self, window, False, num_blocks)

    @rule(
        capacity=st.sampled_from([0, 1, 2, 16]),
        calls=st.integers(1, 12),
        kind=st.sampled_from(["correct", "wrong", "partly"]),
        k=st.integers(1, 4),
    )
    def run(self, capacity, calls=1, kind="correct", k=1):
        for _ in range(calls):
            proposed = []
            for exp in self.expected.values():
                if exp.handle is not None and self.decoding(exp):
                    exp.handle.set_draft_tokens(self.drafts_for(exp.handle, kind, k))
                    proposed.append(exp.handle)
                    note(f"drafts {kind} before a run")
            before = self.engine.stats()
            super().run(capacity, 1)
            after = self.engine.stats()
            if after.preemptions > before.preemptions and any(
                h.status is pg.RequestStatus.ASSIGNED for h in proposed
            ):
                note("preempted with drafts pending")
            if self.caching and after.drafts_proposed > before.drafts_proposed:
                note("drafts verified with prefix caching")


DraftMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=30, deadline=None)
test_draft_state_machine = DraftMachine.TestCase
