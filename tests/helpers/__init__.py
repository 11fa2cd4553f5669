"""Shared builders for the test suite."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pagedgen as pg
from pagedgen.cache import PagedCacheManager
from pagedgen.engine.faults import FaultInjector
from pagedgen.engine.parts import CacheWrapper, RunnerWrapper, build_engine_parts
from pagedgen.engine.scheduler import AGE_LIMIT
from pagedgen.errors import ExecutionCapacityError, InjectedFault, RetryableExecutionError
from pagedgen.executor.runner import StepRunner
from pagedgen.guidance.masks import MASK_BUDGET_S
from pagedgen.models.synthetic import SyntheticModel, synthetic_greedy

# The recoverable faults a transaction must roll back exactly, one per phase that can fail before commit.
RECOVERABLE = [
    ("checkpoint", InjectedFault("x")),
    ("pack", InjectedFault("x")),
    ("execute", RetryableExecutionError("transient")),
    ("execute", ExecutionCapacityError("oom")),
    ("sample", InjectedFault("x")),
    ("stage", InjectedFault("x")),
    ("validate", InjectedFault("x")),
]
RECOVERABLE_IDS = [f"{p}-{type(e).__name__}" for p, e in RECOVERABLE]

# A JSON schema whose every object requires two more of itself: llguidance's item limit refuses it.
RECURSIVE = {
    "$defs": {
        "n": {
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/n"}, "b": {"$ref": "#/$defs/n"}},
            "required": ["a", "b"],
        }
    },
    "$ref": "#/$defs/n",
}

# ---- engine on the synthetic model ------------------------------------------------------------------

VOCAB = 257


def synthetic_model(
    vocab_size: int = VOCAB,
    eos_token_id: int | None = None,
    max_context: int = 4096,
    window: int | None = None,
    hybrid: bool = False,
):
    """The synthetic model; with ``window`` a sliding-window layer too, with ``hybrid`` a fixed conv state."""
    return SyntheticModel(
        vocab_size=vocab_size,
        eos_token_id=eos_token_id,
        max_context=max_context,
        window=window,
        hybrid=hybrid,
    )


@dataclass(frozen=True)
class SyntheticFamily:
    """Which synthetic model a test runs on (a test's fixture hands it in): dense, with a sliding-window
    layer, with fixed conv state, or both; its engines and its greedy oracle agree on that choice."""

    window: int | None = None
    hybrid: bool = False

    def model(self, vocab_size: int = VOCAB, eos_token_id: int | None = None) -> SyntheticModel:
        return synthetic_model(vocab_size, eos_token_id, window=self.window, hybrid=self.hybrid)

    def engine(self, **config: Any) -> pg.Engine:
        return make_engine(self.model(), **config)

    def greedy(self, prompt: Sequence[int], n: int, vocab_size: int = VOCAB) -> list[int]:
        return expected_greedy(prompt, n, vocab_size, hybrid=self.hybrid)


def make_engine(
    model: Any = None,
    *,
    faults: FaultInjector | None = None,
    wrap_runner: RunnerWrapper | None = None,
    wrap_cache: CacheWrapper | None = None,
    age_limit: int = AGE_LIMIT,
    mask_budget_s: float = MASK_BUDGET_S,
    **config: Any,
) -> pg.Engine:
    """An engine with invariant checking on (tests always validate accounting after each step); the
    keyword-only arguments go to :func:`build_engine_parts` (a test's own fault injector, spies)."""
    config.setdefault("debug_invariants", True)
    config.setdefault("num_blocks", 256)
    model = model if model is not None else synthetic_model()
    engine_config = pg.EngineConfig(**config)
    parts = build_engine_parts(
        model,
        engine_config,
        faults=faults,
        wrap_runner=wrap_runner,
        wrap_cache=wrap_cache,
        age_limit=age_limit,
        mask_budget_s=mask_budget_s,
    )
    return pg.Engine(model, engine_config, parts=parts)


def submit(
    engine: pg.Engine,
    tokens: Sequence[int],
    max_new_tokens: int = 0,
    *,
    max_session_tokens: int = 0,
    stop_strings: Sequence[str] = (),
    logprobs: int = 0,
    **search: Any,
) -> pg.Request:
    """Create a request and begin its first turn."""
    params = pg.GeneratorParams(engine.model)
    if search:
        params.set_search_options(**search)
    options = pg.RequestOptions()
    options.set_max_session_tokens(max_session_tokens)
    request = engine.create_request(params, options)
    request.begin_turn(list(tokens), turn_options(request, max_new_tokens, stop_strings, logprobs))
    return request


def turn_options(
    request: pg.Request, max_new_tokens: int = 0, stop_strings: Sequence[str] = (), logprobs: int = 0
) -> pg.TurnOptions:
    options = pg.TurnOptions(request)
    options.set_max_generated_tokens(max_new_tokens)
    if stop_strings:
        options.set_stop_strings(list(stop_strings))
    if logprobs:
        options.set_logprobs(logprobs)
    return options


def drain(engine: pg.Engine, capacity: int = 64, max_calls: int = 100_000) -> list[pg.EngineEvent]:
    """Run until nothing is pending; every event in order (the public engine loop)."""
    buffer = engine.create_event_buffer(capacity)
    events: list[pg.EngineEvent] = []
    calls = 0
    while engine.has_pending_requests():
        events.extend(engine.run(buffer))
        calls += 1
        assert calls < max_calls, "engine made no progress"
    return events


def tokens_of(events: Sequence[pg.EngineEvent]) -> dict[pg.Request, list[int]]:
    """TOKEN payloads grouped by request, in order."""
    out: dict[pg.Request, list[int]] = defaultdict(list)
    for event in events:
        if event.flags & pg.EngineEventFlags.TOKEN:
            out[event.request].append(event.token)
    return out


def finishes_of(events: Sequence[pg.EngineEvent]) -> dict[pg.Request, list[pg.EngineEvent]]:
    """TURN_FINISHED events grouped by request."""
    out: dict[pg.Request, list[pg.EngineEvent]] = defaultdict(list)
    for event in events:
        if event.flags & pg.EngineEventFlags.TURN_FINISHED:
            out[event.request].append(event)
    return out


def event_key(event: pg.EngineEvent) -> tuple:
    """A comparable summary of an event (request identity by id)."""
    rid = None if event.request is None else event.request.id
    return (
        rid,
        event.turn_id,
        int(event.flags),
        event.token,
        event.finish_reason,
        event.usage,
        event.error_code,
    )


def expected_greedy(
    prompt: Sequence[int], n: int, vocab_size: int = VOCAB, eos: int | None = None, hybrid: bool = False
) -> list[int]:
    return synthetic_greedy(list(prompt), n, vocab_size, eos, hybrid=hybrid)


def engine_snapshot(engine: pg.Engine) -> dict[str, Any]:
    """Everything committed about an engine's requests, cache and retained events, as comparable values: the
    engine's and its parts' own ``snapshot()``, so new state is covered without a change here."""
    return engine.snapshot()


def cursor_state(cursor) -> tuple | None:
    """A grammar cursor's observable state: tokens consumed, next-token mask, stopped, poisoned."""
    return None if cursor is None else cursor.snapshot()


class _EvictionSpy:
    """A cache manager that records every cached block its reservations evict, then delegates."""

    def __init__(self, cache: PagedCacheManager, evicted: set[int]):
        self._cache = cache
        self._evicted = evicted

    def reserve(self, *args, **kwargs):
        reservation = self._cache.reserve(*args, **kwargs)
        self._evicted.update(block for block, _, _ in reservation.evicted)
        return reservation

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)


def spy_evictions(evicted: set[int]) -> CacheWrapper:
    """``wrap_cache`` for :func:`make_engine`: ``evicted`` fills with every cached block a reservation
    evicts to make room."""
    return lambda cache: _EvictionSpy(cache, evicted)  # type: ignore[return-value]


def after_rollback(before: dict[str, Any], evicted: set[int]) -> dict[str, Any]:
    """What :func:`engine_snapshot` must be after a rolled-back step, given ``before`` and the cached blocks
    the step evicted whose content its model may have overwritten: those come back FREE and unnamed
    (docs/cache.md); everything else is exactly as before."""
    if not evicted or "prefix" not in before:
        return before
    prefix = before["prefix"]
    return {
        **before,
        "free_blocks": sorted(before["free_blocks"] + sorted(evicted)),
        "prefix": {
            "names": {digest: b for digest, b in prefix["names"].items() if b not in evicted},
            "lru": tuple((b, stamp) for b, stamp in prefix["lru"] if b not in evicted),
            "refs": prefix["refs"],
        },
    }


class _StepRecorder:
    """A runner that records each executed step's (query lengths, past lengths), then delegates."""

    def __init__(self, runner: StepRunner, steps: list[tuple[list[int], list[int]]]):
        self._runner = runner
        self._steps = steps

    def execute(self, inputs):
        self._steps.append((inputs.query_lens.tolist(), inputs.past_lens.tolist()))
        return self._runner.execute(inputs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)


def record_steps(steps: list[tuple[list[int], list[int]]]) -> RunnerWrapper:
    """``wrap_runner`` for :func:`make_engine`: ``steps`` fills with each executed step's (query lengths,
    past lengths), in row order."""
    return lambda runner: _StepRecorder(runner, steps)  # type: ignore[return-value]


def fixed_snapshot(pool) -> dict[str, Any]:
    """A fixed-state pool's committed state (its own ``snapshot()``)."""
    return pool.snapshot()


# ---- guidance: does a constraint accept a text? -----------------------------------------------------


class _ByteTokenizer:
    """Token i < 256 is byte i; 256 is EOS: enough for llguidance to match any text byte by byte."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


_BYTE_VIEW: Any = None


def guidance_accepts(kind: str, data: object, text: str) -> bool:
    """True when the whole of ``text`` is a complete output of the constraint ``(kind, data)``."""
    global _BYTE_VIEW
    import llguidance

    from pagedgen.guidance import compile_guidance

    if _BYTE_VIEW is None:
        _BYTE_VIEW = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))
    matcher = llguidance.LLMatcher(_BYTE_VIEW, compile_guidance(kind, data).grammar, log_level=0)
    return matcher.consume_tokens(list(text.encode("utf-8"))) and matcher.is_accepting()
