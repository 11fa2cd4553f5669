"""``pagedgen bench throughput``: run a workload offline on pagedgen and each baseline, one record per system.

All requests are submitted at once (like ``vllm bench throughput``); each system generates exactly the
workload's greedy tokens per request (EOS ignored). pagedgen runs first, in fp32 (the bench loads the model
at its default dtype), and its outputs are the fp32 reference every record's match rate is computed against
(pagedgen's own is 1 by construction). Each system gets a short untimed warm-up (first-call
allocations, thread-pool start) before its timed run, and both thread pools are restored to their full size
before every system so a baseline never inherits pagedgen's parked torch pool.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from pagedgen.bench.memory import PeakRss
from pagedgen.bench.profile import ProfileSummary, StepProfiler
from pagedgen.bench.progress import ProgressLine
from pagedgen.bench.records import BenchRecord, RunStatus, SystemRun, SystemSkipped, make_record
from pagedgen.bench.roofline import flop_model_of
from pagedgen.bench.workloads import BenchRequest, WorkloadSpec, build_workload
from pagedgen.core.json_value import JsonObject
from pagedgen.errors import EngineError
from pagedgen.ops.matmul.gemm_threads import torch_pool

if TYPE_CHECKING:
    from pagedgen.bench.loaded import BenchModel, BenchTokenizer
    from pagedgen.engine.config import EngineConfig
    from pagedgen.engine.engine import Engine
    from pagedgen.engine.events import EngineEventBuffer
    from pagedgen.models.model import Model
    from pagedgen.spec.driver import DraftDriver

WARMUP_REQUESTS = 2
WARMUP_TOKENS = 4


@dataclass(frozen=True, slots=True)
class PagedgenOptions:
    """Engine settings of the pagedgen run (``max_batch_size`` may be overridden per workload).

    ``speculative`` ("ngram"): each workload also runs as ``pagedgen+ngram``, with the prompt-lookup proposer
    above the engine (``num_speculative_tokens`` drafts per step), right after the plain run.
    """

    max_batch_size: int = 32
    max_scheduled_tokens: int = 2048
    block_size: int = 16
    num_blocks: int | None = None
    chunk_size: int | None = None
    speculative: str | None = None
    num_speculative_tokens: int = 4
    cuda_graphs: bool = True

    def engine_config(self, max_batch_size: int | None = None) -> EngineConfig:
        from pagedgen.engine.config import EngineConfig

        return EngineConfig(
            max_batch_size=max_batch_size or self.max_batch_size,
            max_scheduled_tokens=self.max_scheduled_tokens,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            chunk_size=self.chunk_size,
            cuda_graphs=self.cuda_graphs,
        )


@dataclass(slots=True)
class PagedgenRun:
    """pagedgen's run plus, when profiled, the step-phase breakdown."""

    run: SystemRun
    profiler: StepProfiler | None = None


def run_pagedgen(
    model: BenchModel,
    requests: Sequence[BenchRequest],
    config: EngineConfig,
    *,
    profile: bool = False,
    speculative: str | None = None,
    num_speculative_tokens: int = 4,
    progress: ProgressLine | None = None,
) -> PagedgenRun:
    """Generate every request's tokens on one fresh Engine; returns outputs in request order.

    ``speculative`` puts that proposer above the engine (:func:`pagedgen.spec.make_driver`); ``progress``
    is told each step's tokens and finished requests. Raises :class:`EngineError` if the engine fails or a
    turn ends before its requested length.
    """
    from pagedgen.engine.engine import Engine
    from pagedgen.spec import make_driver

    profiler = StepProfiler() if profile else None
    engine = Engine(model, config, parts=None if profiler is None else profiler.parts(model, config))
    try:
        drafter = make_driver(engine, speculative, num_speculative_tokens)
        buffer = engine.create_event_buffer(4 * config.max_batch_size + 16)
        start = time.perf_counter()
        outputs, peak_blocks = _drive(engine, buffer, model, requests, profiler, drafter, progress)
        wall = time.perf_counter() - start
        stats = engine.stats()
        details = {"steps": stats.steps, "rollbacks": stats.rollbacks}
        if drafter is not None:
            details.update(
                drafts_proposed=stats.drafts_proposed,
                drafts_accepted=stats.drafts_accepted,
                draft_acceptance_rate=stats.draft_acceptance_rate,
                num_speculative_tokens=num_speculative_tokens,
            )
        run = SystemRun(
            outputs, wall, kv_blocks_used=peak_blocks, kv_blocks_total=stats.total_blocks, details=details
        )
        return PagedgenRun(run, profiler)
    finally:
        engine.close()


def _drive(
    engine: Engine,
    buffer: EngineEventBuffer,
    model: BenchModel,
    requests: Sequence[BenchRequest],
    profiler: StepProfiler | None,
    drafter: DraftDriver | None = None,
    progress: ProgressLine | None = None,
) -> tuple[list[list[int]], int]:
    """Submit all requests, run the engine loop to completion (``drafter`` proposing before each step);
    returns outputs and peak blocks in use."""
    from pagedgen.engine.events import EngineEventFlags, FinishReason
    from pagedgen.engine.request import GeneratorParams, RequestOptions, TurnOptions

    params = GeneratorParams(model)
    params.set_search_options(do_sample=False, ignore_eos=True)
    index_of: dict[int, int] = {}
    handles = []
    for i, r in enumerate(requests):
        handle = engine.create_request(params, RequestOptions())
        options = TurnOptions(handle)
        options.set_max_generated_tokens(r.output_len)
        handle.begin_turn(list(r.prompt_ids), options)
        index_of[id(handle)] = i
        handles.append(handle)
    outputs: list[list[int]] = [[] for _ in requests]
    peak_blocks = 0
    open_handles = {id(h): h for h in handles}
    while engine.has_pending_requests():
        if drafter is not None:
            drafter.propose(open_handles.values())
        events = profiler.run(engine, buffer) if profiler is not None else engine.run(buffer)
        tokens_before, open_before = sum(map(len, outputs)), len(open_handles)
        for event in events:
            if event.request is None:
                if event.flags & EngineEventFlags.FAILED:
                    raise EngineError(f"the engine failed: {event.error_code.value}")
                continue
            i = index_of[id(event.request)]
            if event.token is not None:
                outputs[i].append(event.token)
            if event.flags & EngineEventFlags.TURN_FINISHED:
                if event.finish_reason is not FinishReason.MAX_GENERATED_TOKENS:
                    raise EngineError(f"request {i} finished with {event.finish_reason.value}")
                del open_handles[id(event.request)]
                event.request.close()
        if progress is not None:
            progress.advance(sum(map(len, outputs)) - tokens_before, open_before - len(open_handles))
        stats = engine.stats()
        peak_blocks = max(peak_blocks, stats.total_blocks - stats.free_blocks)
    return outputs, peak_blocks


# A system runner: (workload requests, max batch size) -> SystemRun, or raises SystemSkipped.
SystemRunner = Callable[[Sequence[BenchRequest], int], SystemRun]


@dataclass(frozen=True, slots=True)
class Reference:
    """The greedy outputs every system's match rate is computed against, and what produced them."""

    outputs: list[list[int]]
    name: str


def reference_name(model: BenchModel) -> str:
    """``"pagedgen fp32"`` for a float32 model (the bench's case), else the dtype it ran in; a model that
    records its weight format (``weights_format``: native blocks or float32) says which."""
    dtype = getattr(model, "dtype", torch.float32)
    name = "pagedgen fp32" if dtype == torch.float32 else f"pagedgen {str(dtype).removeprefix('torch.')}"
    weights = getattr(model, "weights_format", None)
    return name if weights is None else f"{name} ({getattr(weights, 'value', weights)} weights)"


@dataclass(slots=True)
class ThroughputResult:
    """Everything one ``bench throughput`` invocation measured."""

    records: list[BenchRecord] = field(default_factory=list)
    profiles: dict[str, ProfileSummary] = field(default_factory=dict)  # "W1" / "W1@32" -> summary
    peers: JsonObject = field(default_factory=dict)  # a peer's own figures, e.g. "llama-bench"
    machine: JsonObject = field(default_factory=dict)


def warmup_requests(requests: Sequence[BenchRequest]) -> list[BenchRequest]:
    """A tiny slice of the workload: a system's first-call costs stay out of its timed run."""
    return [replace(r, output_len=min(r.output_len, WARMUP_TOKENS)) for r in requests[:WARMUP_REQUESTS]]


def bench_workload(
    spec: WorkloadSpec,
    model: BenchModel,
    tokenizer: BenchTokenizer,
    options: PagedgenOptions,
    baselines: dict[str, SystemRunner],
    *,
    peak_flops: float | None,
    profile: bool = False,
    result: ThroughputResult,
    log: Callable[[str], None] = print,
    reference_model: Model | None = None,
) -> None:
    """Run ``spec`` on pagedgen then on every baseline (in the given order); appends records to ``result``.

    ``reference_model`` (the same checkpoint on float32 weights, when ``model`` runs native weights) runs
    first as ``pagedgen-f32w``; its outputs are then the fp32 reference of every record's match rate.
    """
    requests = build_workload(spec, tokenizer)
    batch = spec.max_batch_size or options.max_batch_size
    flops = flop_model_of(model)
    model_flops = None if flops is None else flops.workload_flops(requests)
    log(f"[{spec.name}] {spec.describe()}; max batch {batch}")
    config = options.engine_config(batch)
    torch_pool.restore()
    reference = None
    if reference_model is not None:  # pagedgen on float32 weights first: the reference of every record
        run_pagedgen(reference_model, warmup_requests(requests), config)
        with PeakRss() as rss:
            f32 = run_pagedgen(
                reference_model, requests, config, progress=_progress("pagedgen-f32w", requests, log)
            )
        reference = Reference(f32.run.outputs, reference_name(reference_model))
        costs = (model_flops, peak_flops, rss.peak_bytes)
        _record_pagedgen(spec, "pagedgen-f32w", requests, f32.run, costs, batch, reference, result, log)
    run_pagedgen(model, warmup_requests(requests), config)
    with PeakRss() as rss:
        paged = run_pagedgen(
            model, requests, config, profile=profile, progress=_progress("pagedgen", requests, log)
        )
    if reference is None:
        reference = Reference(paged.run.outputs, reference_name(model))
    costs = (model_flops, peak_flops, rss.peak_bytes)
    _record_pagedgen(spec, "pagedgen", requests, paged.run, costs, batch, reference, result, log)
    if paged.profiler is not None:
        result.profiles[spec.name] = paged.profiler.summary()
        result.profiles[f"{spec.name}@{batch}"] = paged.profiler.summary(resident=[batch])
    if options.speculative is not None:
        _bench_speculative(spec, model, requests, config, options, costs, batch, reference, result, log)
    for name, runner in baselines.items():
        log(f"  {name:<14} ... running (warm-up, then {len(requests)} requests)")
        record = _run_baseline(spec, name, runner, requests, batch, reference, model_flops, peak_flops)
        result.records.append(record)
        log(_one_line(record))


def _progress(label: str, requests: Sequence[BenchRequest], log: Callable[[str], None]) -> ProgressLine:
    """A progress line for one timed pagedgen run of ``requests``."""
    total = sum(r.output_len for r in requests)
    return ProgressLine(label, total_tokens=total, total_requests=len(requests), log=log)


def _record_pagedgen(
    spec: WorkloadSpec,
    system: str,
    requests: list[BenchRequest],
    run: SystemRun,
    costs: tuple[float | None, float | None, int | None],
    batch: int,
    reference: Reference,
    result: ThroughputResult,
    log: Callable[[str], None],
) -> None:
    """Append (and log) the record of one pagedgen run; ``costs`` = (model FLOPs, peak FLOP/s, peak RSS)."""
    model_flops, peak_flops, peak_rss = costs
    record = make_record(
        spec.name,
        system,
        requests,
        run,
        model_flops=model_flops,
        peak_flops=peak_flops,
        peak_rss_bytes=peak_rss,
        reference=reference.outputs,
        reference_name=reference.name,
    )
    record.details["max_batch_size"] = batch
    result.records.append(record)
    log(_one_line(record))


def _bench_speculative(
    spec: WorkloadSpec,
    model: BenchModel,
    requests: list[BenchRequest],
    config: EngineConfig,
    options: PagedgenOptions,
    costs: tuple[float | None, float | None, int | None],
    batch: int,
    reference: Reference,
    result: ThroughputResult,
    log: Callable[[str], None],
) -> None:
    """The same workload with the proposer above the engine, right after the plain run (same machine
    state); logs its output-throughput ratio to the plain run and its draft acceptance."""
    method, k = options.speculative, options.num_speculative_tokens
    run_pagedgen(model, warmup_requests(requests), config, speculative=method, num_speculative_tokens=k)
    with PeakRss() as rss:
        drafted = run_pagedgen(
            model,
            requests,
            config,
            speculative=method,
            num_speculative_tokens=k,
            progress=_progress(f"pagedgen+{method}", requests, log),
        )
    costs = (costs[0], costs[1], rss.peak_bytes)
    _record_pagedgen(spec, f"pagedgen+{method}", requests, drafted.run, costs, batch, reference, result, log)
    plain = next(r for r in reversed(result.records) if r.workload == spec.name and r.system == "pagedgen")
    new = result.records[-1]
    if plain.output_tokens_per_s and new.output_tokens_per_s:
        d = drafted.run.details
        new.details["speedup_vs_pagedgen"] = new.output_tokens_per_s / plain.output_tokens_per_s
        log(
            f"  {'':<14} {new.details['speedup_vs_pagedgen']:.2f}x pagedgen; drafts accepted "
            f"{d['drafts_accepted']}/{d['drafts_proposed']} ({d['draft_acceptance_rate']:.1%})"
        )


def _run_baseline(
    spec: WorkloadSpec,
    name: str,
    runner: SystemRunner,
    requests: list[BenchRequest],
    batch: int,
    reference: Reference,
    model_flops: float | None,
    peak_flops: float | None,
) -> BenchRecord:
    """One baseline's record: OK, SKIPPED with its reason, or FAILED with the error (never raises)."""
    torch_pool.restore()
    try:
        runner(warmup_requests(requests), batch)
        with PeakRss() as rss:
            run = runner(requests, batch)
    except SystemSkipped as skip:
        return make_record(spec.name, name, requests, None, status=RunStatus.SKIPPED, reason=str(skip))
    except Exception as exc:  # a baseline's failure is a result to report, not a reason to stop the bench
        reason = f"{type(exc).__name__}: {exc}"
        return make_record(spec.name, name, requests, None, status=RunStatus.FAILED, reason=reason)
    record = make_record(
        spec.name,
        name,
        requests,
        run,
        model_flops=model_flops,
        peak_flops=peak_flops,
        peak_rss_bytes=rss.peak_bytes,
        reference=reference.outputs,
        reference_name=reference.name,
    )
    record.details["max_batch_size"] = batch
    return record


def _one_line(record: BenchRecord) -> str:
    if record.status is not RunStatus.OK:
        return f"  {record.system:<14} {record.status.value}: {record.reason}"
    match = "" if record.match_rate is None else f", match {record.match_rate:.1%}"
    return (
        f"  {record.system:<14} {record.output_tokens_per_s:8.1f} out tok/s, "
        f"{record.total_tokens_per_s:8.1f} total tok/s, {record.wall_s:7.2f} s{match}"
    )
