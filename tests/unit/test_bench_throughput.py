"""bench throughput plumbing on the synthetic model: exact outputs, records per system, skips, match rates,
the step profile and the command line's JSON / markdown / PNG output. No timing is asserted."""

from __future__ import annotations

import json

import pytest

import pagedgen.bench.ort_genai as ort_genai
from pagedgen.bench.baselines import BASELINE_NAMES, baseline_runners, left_pad
from pagedgen.bench.checkpoints import NO_CHECKPOINT
from pagedgen.bench.cli import main
from pagedgen.bench.cpu import cpu_flags
from pagedgen.bench.extras import INSTALL_HINT
from pagedgen.bench.profile import PHASE_GROUPS, PhaseClock, StepProfiler, phase_durations
from pagedgen.bench.records import RunStatus, SystemRun, SystemSkipped
from pagedgen.bench.report import REQUIRED_KEYS
from pagedgen.bench.throughput import PagedgenOptions, ThroughputResult, bench_workload, run_pagedgen
from pagedgen.bench.workloads import LengthRange, WorkloadSpec, batches, build_workload
from pagedgen.engine.engine import Engine
from pagedgen.engine.events import EngineErrorCode, EngineEventFlags
from pagedgen.engine.outcomes import Phase
from pagedgen.engine.request import GeneratorParams, RequestOptions, TurnOptions
from pagedgen.models.synthetic import SyntheticModel, synthetic_greedy
from pagedgen.ops.kernels import native

MODEL = SyntheticModel()
SPEC = WorkloadSpec("tiny", 6, LengthRange(3, 20), LengthRange(2, 9), seed=5)
OPTIONS = PagedgenOptions(max_batch_size=4, num_blocks=64)


def _expected(requests):
    return [synthetic_greedy(r.prompt_ids, r.output_len, MODEL.vocab_size) for r in requests]


def test_pagedgen_run_generates_each_requests_exact_greedy_tokens():
    requests = build_workload(SPEC, MODEL.tokenizer)
    paged = run_pagedgen(MODEL, requests, OPTIONS.engine_config())
    assert paged.run.outputs == _expected(requests)
    assert paged.run.kv_blocks_total == 64
    assert 0 < paged.run.kv_blocks_used <= 64
    assert paged.run.details["steps"] > 0 and paged.run.details["rollbacks"] == 0
    assert paged.profiler is None


def test_speculative_option_adds_a_pagedgen_ngram_record_with_its_drafts():
    requests = build_workload(SPEC, MODEL.tokenizer)
    options = PagedgenOptions(max_batch_size=4, num_blocks=64, speculative="ngram", num_speculative_tokens=3)
    result = ThroughputResult()
    bench_workload(SPEC, MODEL, MODEL.tokenizer, options, {}, peak_flops=None, result=result, log=str)
    plain, drafted = result.records
    assert (plain.system, drafted.system) == ("pagedgen", "pagedgen+ngram")
    assert drafted.match_rate == 1.0 and drafted.exact_match_requests == len(requests)
    details = drafted.details
    assert details["num_speculative_tokens"] == 3 and details["speedup_vs_pagedgen"] > 0
    assert 0 <= details["drafts_accepted"] <= details["drafts_proposed"]
    assert "drafts_proposed" not in plain.details


def _greedy_runner(requests, batch):
    return SystemRun(_expected(requests), wall_s=1.0)


def _one_token_off(requests, batch):
    outputs = _expected(requests)
    outputs[0][1] = (outputs[0][1] + 1) % MODEL.vocab_size  # diverges at token 1 of request 0
    return SystemRun(outputs, wall_s=1.0)


def _skipping(requests, batch):
    raise SystemSkipped("not on this machine")


def _crashing(requests, batch):
    raise RuntimeError("kaboom")


def test_bench_workload_records_every_system_with_its_status_and_match_rate():
    requests = build_workload(SPEC, MODEL.tokenizer)
    baselines = {"same": _greedy_runner, "off": _one_token_off, "skip": _skipping, "crash": _crashing}
    result = ThroughputResult()
    bench_workload(
        SPEC,
        MODEL,
        MODEL.tokenizer,
        OPTIONS,
        baselines,
        peak_flops=None,
        profile=True,
        result=result,
        log=str,
    )
    by_system = {r.system: r for r in result.records}
    assert list(by_system) == ["pagedgen", "same", "off", "skip", "crash"]
    total_out = sum(r.output_len for r in requests)
    paged = by_system["pagedgen"]
    assert paged.status is RunStatus.OK and paged.output_tokens == total_out
    assert (paged.match_rate, paged.exact_match_requests) == (1.0, len(requests))  # it is the reference
    assert {r.reference for r in result.records} == {"pagedgen fp32", None}  # None: skipped / failed
    assert all(r.cpu_flags == list(cpu_flags()) for r in result.records)
    assert paged.roofline_fraction is None  # the synthetic model has no FLOP model
    assert paged.details["max_batch_size"] == 4
    assert by_system["same"].match_rate == 1.0 and by_system["same"].exact_match_requests == len(requests)
    off = by_system["off"]
    assert off.matched_tokens == total_out - (requests[0].output_len - 1)
    assert off.exact_match_requests == len(requests) - 1
    assert (by_system["skip"].status, by_system["skip"].reason) == (RunStatus.SKIPPED, "not on this machine")
    assert (by_system["crash"].status, by_system["crash"].reason) == (
        RunStatus.FAILED,
        "RuntimeError: kaboom",
    )
    assert set(result.profiles) == {"tiny", "tiny@4"}
    summary = result.profiles["tiny"]
    assert summary.steps == paged.details["steps"]
    assert set(summary.group_s) == set(PHASE_GROUPS)
    assert sum(summary.group_s.values()) + summary.other_s == pytest.approx(summary.total_s)


def test_workload_batch_size_overrides_the_command_default():
    spec = WorkloadSpec("one", 2, LengthRange(4, 4), LengthRange(3, 3), max_batch_size=1)
    result = ThroughputResult()
    bench_workload(spec, MODEL, MODEL.tokenizer, OPTIONS, {}, peak_flops=None, result=result, log=str)
    assert result.records[0].details["max_batch_size"] == 1


def _skip_reasons(names):
    requests = build_workload(SPEC, MODEL.tokenizer)
    reasons = {}
    for name, runner in baseline_runners(names, None).items():
        with pytest.raises(SystemSkipped) as skip:
            runner(requests, 4)
        reasons[name] = str(skip.value)
    return reasons


def test_baselines_without_a_checkpoint_are_skipped_with_reasons(monkeypatch):
    monkeypatch.setattr(ort_genai, "importable", lambda module: True)
    assert _skip_reasons(BASELINE_NAMES) == dict.fromkeys(BASELINE_NAMES, NO_CHECKPOINT)
    with pytest.raises(ValueError, match=r"unknown baseline\(s\) \['tgi'\]"):
        baseline_runners(["hf-static", "tgi"], None)


def test_ort_genai_without_the_bench_extra_is_skipped_naming_it(monkeypatch):
    monkeypatch.setattr(ort_genai, "importable", lambda module: False)
    reason = f"onnxruntime_genai is not importable in this environment ({INSTALL_HINT})"
    assert _skip_reasons(["ort-genai", "ort-genai-int4"]) == {"ort-genai": reason, "ort-genai-int4": reason}


def test_static_batching_helpers():
    assert left_pad([(1, 2, 3), (4,)], 0) == ([[1, 2, 3], [0, 0, 4]], [[1, 1, 1], [0, 0, 1]])
    assert [list(b) for b in batches([1, 2, 3, 4, 5], 2)] == [[1, 2], [3, 4], [5]]
    with pytest.raises(ValueError, match="batch size must be positive"):
        batches([1], 0)


def test_phase_durations_and_clock_forwarding():
    marks = [(Phase.PLAN, 1.0), (Phase.PACK, 1.5), (Phase.EXECUTE, 2.0), (Phase.PLAN, 4.0)]
    assert phase_durations(marks, 5.0) == {Phase.PLAN: 1.5, Phase.PACK: 0.5, Phase.EXECUTE: 2.0}

    class Inner:
        hits = 0
        seen: tuple = ()

        def check(self, phase, request_ids=()):
            self.hits += 1
            self.seen = tuple(request_ids)

    clock = PhaseClock(Inner())
    clock.check(Phase.PLAN, (3, 4))
    assert clock.hits == 1 and clock.seen == (3, 4) and [p for p, _ in clock.marks] == [Phase.PLAN]


def test_profiler_times_only_an_engine_built_from_its_parts():
    profiler = StepProfiler()
    config = OPTIONS.engine_config()
    with pytest.raises(RuntimeError, match="not built from StepProfiler.parts"):
        profiler.run(object(), None)
    plain = Engine(MODEL, config)
    try:
        with pytest.raises(RuntimeError, match="not built from StepProfiler.parts"):
            profiler.run(plain, plain.create_event_buffer(8))
    finally:
        plain.close()
    parts = profiler.parts(MODEL, config)
    assert parts.faults is profiler.clock
    engine = Engine(MODEL, config, parts=parts)
    try:
        handle = engine.create_request(GeneratorParams(MODEL), RequestOptions())
        options = TurnOptions(handle)
        options.set_max_generated_tokens(3)
        handle.begin_turn([5, 6, 7], options)
        events = profiler.run(engine, engine.create_event_buffer(8))
        assert [e.token for e in events] == synthetic_greedy([5, 6, 7], 1, MODEL.vocab_size)
        step_phases = [phase for phase, _ in profiler.clock.marks]
        assert step_phases[:6] == [
            Phase.PLAN,
            Phase.RESERVE,
            Phase.CHECKPOINT,
            Phase.PACK,
            Phase.EXECUTE,
            Phase.SAMPLE,
        ]
        assert step_phases[-1] is Phase.PUBLISH
        assert set(profiler.samples[0].phases) == set(step_phases)
        engine.parts.faults.arm(Phase.EXECUTE)  # through the clock, to the injector it forwards to
        (failed,) = profiler.run(engine, engine.create_event_buffer(8))
        assert (
            failed.flags & EngineEventFlags.FAILED
            and failed.error_code is EngineErrorCode.ENGINE_EXECUTION_FAILURE
        )
        assert [phase for phase, _ in profiler.clock.marks][-1] is Phase.EXECUTE
    finally:
        engine.close()


def test_cli_writes_json_markdown_and_chart(tmp_path, capsys):
    out = tmp_path / "bench.json"
    status = main(
        [
            "throughput",
            "--model",
            "synthetic",
            "--num-prompts",
            "5",
            "--input-len",
            "4:12",
            "--output-len",
            "3:6",
            "--max-batch-size",
            "2",
            "--num-blocks",
            "64",
            "--baselines",
            "hf-static,vllm",
            "--no-roofline",
            "--profile",
            "--json",
            str(out),
            "--markdown",
            str(tmp_path / "table.md"),
        ]
    )
    assert status == 0
    document = json.loads(out.read_text())
    assert document["command"].startswith("pagedgen bench throughput --model synthetic")
    assert document["machine"]["cpus"] >= 1 and document["machine"]["gemm_peak_gflops"] is None
    assert document["machine"]["kernel_march"] == native.kernel_march()
    assert [(r["workload"], r["system"], r["status"]) for r in document["records"]] == [
        ("custom", "pagedgen", "ok"),
        ("custom", "hf-static", "skipped"),
        ("custom", "vllm", "skipped"),
    ]
    assert all(all(key in r for key in REQUIRED_KEYS) for r in document["records"])
    custom = build_workload(WorkloadSpec("custom", 5, LengthRange(4, 12), LengthRange(3, 6)), MODEL.tokenizer)
    assert document["records"][0]["output_tokens"] == sum(r.output_len for r in custom)
    assert set(document["profiles"]) == {"custom", "custom@2"}
    assert (tmp_path / "bench.png").stat().st_size > 0
    assert (tmp_path / "table.md").read_text().startswith("| workload | system |")
    printed = capsys.readouterr().out
    assert "| custom | pagedgen |" in printed and "profile custom:" in printed


def test_cli_usage_errors_return_2(capsys):
    assert main(["throughput", "--model", "synthetic", "--workload", "W9", "--no-roofline"]) == 2
    assert "unknown workload 'W9'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["throughput", "--max-batch-size", "0"])


def test_a_float32_weights_reference_runs_first_and_every_match_is_against_it():
    """With native weights, the same checkpoint on float32 weights is the reference (here: a synthetic model
    whose vocabulary differs, so its outputs, and so the matches against it, differ visibly)."""

    class Float32Weights(SyntheticModel):
        weights_format = "float32"

    reference_model = Float32Weights(vocab_size=MODEL.vocab_size - 1)
    result = ThroughputResult()
    bench_workload(
        SPEC,
        MODEL,
        MODEL.tokenizer,
        OPTIONS,
        {"same": _greedy_runner},
        peak_flops=None,
        result=result,
        log=str,
        reference_model=reference_model,
    )
    assert [r.system for r in result.records] == ["pagedgen-f32w", "pagedgen", "same"]
    assert {r.reference for r in result.records} == {"pagedgen fp32 (float32 weights)"}
    f32w, paged, same = result.records
    assert f32w.match_rate == 1.0 and f32w.exact_match_requests == SPEC.num_requests
    assert paged.match_rate < 1.0 and same.match_rate == paged.match_rate
