"""``--profile``: split each engine step's time into planning, packing, forward, sampling, commit/publish.

The step enters each phase through its fault-injection seam (``parts.faults.check(phase)``, see
:mod:`pagedgen.engine.faults`). :class:`PhaseClock` fills that seam: the profiled engine is built from
:meth:`StepProfiler.parts`, whose fault injector is the clock, which timestamps every phase entry and
forwards the call to a plain injector, so armed faults still fire. A phase lasts until the next phase
starts; the last one (publish) until ``engine.run`` returns, which also covers draining the events into the
caller's buffer. Nothing in the engine changes behaviour while profiled.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedgen.core.json_value import JsonObject
from pagedgen.engine.faults import FaultInjector
from pagedgen.engine.outcomes import Phase

if TYPE_CHECKING:
    from pagedgen.core.decoder import DecoderModel
    from pagedgen.engine.config import EngineConfig
    from pagedgen.engine.engine import Engine
    from pagedgen.engine.events import EngineEventBuffer
    from pagedgen.engine.parts import EngineParts

PHASE_GROUPS: dict[str, tuple[Phase, ...]] = {
    "planning": (Phase.PLAN, Phase.RESERVE, Phase.CHECKPOINT),
    "packing": (Phase.PACK,),
    "forward": (Phase.EXECUTE,),
    "sampling": (Phase.SAMPLE, Phase.STAGE),
    "commit_publish": (Phase.VALIDATE, Phase.COMMIT_REQUEST, Phase.COMMIT_CACHE, Phase.PUBLISH),
}
NON_MODEL_GROUPS = ("planning", "packing", "sampling", "commit_publish")


class ProfileUnavailable(RuntimeError):
    """The engine's phase seam is not this profiler's clock (it was not built from the profiler's parts)."""


class PhaseClock:
    """Timestamps phase entries and forwards them to the wrapped fault injector."""

    def __init__(self, inner: FaultInjector):
        self.inner = inner
        self.marks: list[tuple[Phase, float]] = []

    def check(self, phase: Phase, request_ids: Collection[int] = ()) -> None:
        self.marks.append((phase, time.perf_counter()))
        self.inner.check(phase, request_ids)

    def __getattr__(self, name: str) -> Any:  # arm/disarm/hits stay the engine injector's
        return getattr(self.inner, name)


@dataclass(slots=True)
class StepSample:
    """One executed step: seconds per phase, the whole ``engine.run`` call, and its batch."""

    phases: dict[Phase, float]
    total_s: float
    sampled_rows: int  # TOKEN events the step produced
    resident_requests: int  # requests holding cache blocks when the step began

    def group_s(self, group: str) -> float:
        return sum(self.phases.get(p, 0.0) for p in PHASE_GROUPS[group])


def phase_durations(marks: list[tuple[Phase, float]], end: float) -> dict[Phase, float]:
    """Seconds per phase from entry timestamps: each phase ends where the next begins, the last at ``end``."""
    durations: dict[Phase, float] = {}
    for (phase, start), stop in zip(marks, [t for _, t in marks[1:]] + [end], strict=True):
        durations[phase] = durations.get(phase, 0.0) + (stop - start)
    return durations


@dataclass(slots=True)
class StepProfiler:
    """Build the engine from :meth:`parts`, then call :meth:`run` instead of ``engine.run``;
    :meth:`summary` aggregates."""

    samples: list[StepSample] = field(default_factory=list)
    clock: PhaseClock = field(default_factory=lambda: PhaseClock(FaultInjector()))

    def parts(self, model: DecoderModel, config: EngineConfig) -> EngineParts:
        """The parts of the engine to profile (``Engine(model, config, parts=...)``): the usual ones, with
        this profiler's clock as the fault injector every phase enters through."""
        from pagedgen.engine.parts import build_engine_parts

        return build_engine_parts(model, config, faults=self.clock)

    def run(self, engine: Engine, buffer: EngineEventBuffer) -> EngineEventBuffer:
        """``engine.run(buffer)``, timed; records a sample when the call executed the model. Raises
        :class:`ProfileUnavailable` for an engine not built from :meth:`parts`."""
        if getattr(getattr(engine, "parts", None), "faults", None) is not self.clock:
            raise ProfileUnavailable("StepProfiler.run on an engine not built from StepProfiler.parts")
        resident = engine.stats().resident_requests
        self.clock.marks.clear()
        start = time.perf_counter()
        events = engine.run(buffer)
        end = time.perf_counter()
        marks = self.clock.marks
        if any(phase is Phase.EXECUTE for phase, _ in marks):
            phases = phase_durations(marks, end)
            rows = sum(1 for e in events if e.token is not None)
            self.samples.append(StepSample(phases, end - start, rows, resident))
        return events

    def summary(self, resident: Iterable[int] | None = None) -> ProfileSummary:
        """Totals over all executed steps, or over those whose resident count is in ``resident``."""
        wanted = None if resident is None else set(resident)
        chosen = [s for s in self.samples if wanted is None or s.resident_requests in wanted]
        return summarize(chosen)


@dataclass(frozen=True, slots=True)
class ProfileSummary:
    steps: int
    total_s: float
    group_s: dict[str, float]
    phase_s: dict[str, float]

    @property
    def other_s(self) -> float:
        """Time in ``engine.run`` outside every phase (reclaiming abandoned requests, bookkeeping)."""
        return self.total_s - sum(self.group_s.values())

    @property
    def non_model_fraction(self) -> float:
        """(planning + packing + sampling + commit/publish + other) / step time; 0 when nothing ran."""
        if self.total_s <= 0:
            return 0.0
        return (sum(self.group_s[g] for g in NON_MODEL_GROUPS) + self.other_s) / self.total_s

    def to_dict(self) -> JsonObject:
        return {
            "steps": self.steps,
            "total_s": self.total_s,
            "group_s": dict(self.group_s),
            "phase_s": dict(self.phase_s),
            "other_s": self.other_s,
            "non_model_fraction": self.non_model_fraction,
        }


def summarize(samples: list[StepSample]) -> ProfileSummary:
    group_s = {g: sum(s.group_s(g) for s in samples) for g in PHASE_GROUPS}
    phase_s = {p.value: sum(s.phases.get(p, 0.0) for s in samples) for p in Phase}
    return ProfileSummary(len(samples), sum(s.total_s for s in samples), group_s, phase_s)


def format_profile(title: str, summary: ProfileSummary) -> str:
    """A small text table: each group's seconds, share of step time and mean per step."""
    lines = [f"{title}: {summary.steps} steps, {summary.total_s:.3f} s in engine.run"]
    if summary.steps == 0:
        return lines[0]
    rows = [*summary.group_s.items(), ("other", summary.other_s)]
    for name, seconds in rows:
        share = seconds / summary.total_s if summary.total_s else 0.0
        lines.append(
            f"  {name:<15} {seconds:9.3f} s {share:7.1%} {seconds / summary.steps * 1e3:9.3f} ms/step"
        )
    lines.append(f"  non-model share {summary.non_model_fraction:.1%}")
    return "\n".join(lines)
