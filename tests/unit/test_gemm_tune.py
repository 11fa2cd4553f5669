"""matmul.gemm_tune / gemm_calibrate: what is measured, how the table and its reasons follow, and the cache.

No test here runs a real multi-second calibration: the measurement is a fake that returns fixed timings
and counts its calls, or a real one on weights of a few KB.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedgen.models.llama import Linear, _set_weight
from pagedgen.models.synthetic import SyntheticModel
from pagedgen.ops.kernels import cpu_info
from pagedgen.ops.kernels.native import NativeStatus
from pagedgen.ops.matmul import gemm, gemm_calibrate, gemm_tune
from pagedgen.ops.matmul.gemm import (
    NATIVE_ONLY,
    OPENBLAS_ONLY,
    TORCH_ONLY,
    UNTUNED,
    GemmBackend,
    GemmTable,
    RowBucket,
    adopt_table,
    set_gemm_table,
    use_gemm_table,
)
from pagedgen.ops.matmul.gemm_calibrate import (
    LinearWeight,
    PassTiming,
    RowCounts,
    derive_table,
    engine_row_counts,
    explain_table,
    model_linear_weights,
    pass_weights,
    time_passes,
)
from pagedgen.ops.matmul.gemm_threads import ThreadSettings
from pagedgen.ops.matmul.quant_calibrate import QuantPassTiming, derive_quant_table, model_quant_weights
from pagedgen.ops.matmul.quant_table import (
    DEQUANT_ONLY,
    KERNEL_ONLY,
    UNCALIBRATED,
    QuantPath,
    active_quant_table,
    set_quant_table,
    use_quant_table,
)
from pagedgen.ops.matmul.qweight import QType, QuantizedWeight
from tests.helpers.linear import QuantRuntime, TinyRuntime

pytestmark = pytest.mark.cpu  # the GEMM table is measured for CPU backends and thread pools

BLAS, TORCH, NATIVE = GemmBackend.OPENBLAS, GemmBackend.TORCH, GemmBackend.NATIVE
LINEAR = (Linear,)
COUNTS = RowCounts(decode=(1, 2, 4), prefill=(16,))
# (torch, openblas, native) seconds: at 1 and 2 rows native is fastest, at 3-4 OpenBLAS, above torch.
SECONDS = {1: (3.0, 2.0, 1.0), 2: (3.0, 2.0, 1.5), 4: (3.0, 1.0, 2.0)}
ABOVE = (1.0, 2.0, 4.0)


class FakeMeasure:
    """Returns :data:`SECONDS` per row count (:data:`ABOVE` above 4 rows); counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, weights, counts):
        self.calls += 1
        return [
            PassTiming(r, 1e9, dict(zip((TORCH, BLAS, NATIVE), SECONDS.get(r, ABOVE), strict=True)))
            for r in (*counts.decode, *counts.prefill)
        ]


class FakeQuantMeasure:
    """Per kind and row count: the kernel 1 s, dequantise 2 s up to 2 rows and 0.5 s above; counts calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, weights, counts):
        self.calls += 1
        kinds = dict.fromkeys(w.kind for w in weights)
        return [
            QuantPassTiming(r, qtype, shape, 1e9, {KERNEL: 1.0, DEQUANT: 2.0 if r <= 2 else 0.5})
            for r in (*counts.decode, *counts.prefill)
            for qtype, shape in kinds
        ]


KERNEL, DEQUANT = QuantPath.KERNEL, QuantPath.DEQUANT


@pytest.fixture(autouse=True)
def _fresh(monkeypatch, tmp_path):
    """A private cache directory, an empty in-process memo, no table override, both tables restored."""
    monkeypatch.setenv("PAGEDGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(gemm_tune.TABLE_ENV, raising=False)
    monkeypatch.setattr(gemm_tune, "_memo", {})
    with use_gemm_table(gemm.active_table()), use_quant_table(active_quant_table()):
        set_gemm_table(UNTUNED, pinned=False)
        set_quant_table(UNCALIBRATED, pinned=False)
        yield


def _weights() -> list[LinearWeight]:
    return model_linear_weights(TinyRuntime(), LINEAR)


# -- the model's weights and the row counts -------------------------------------------------------------


def test_model_weights_count_fused_projections_once_and_mark_the_head():
    weights = model_linear_weights(TinyRuntime(), LINEAR)
    assert [(w.shape, w.every_token) for w in weights] == [
        ((16, 16), True),  # the fused q/k/v (where its first view, q, stood), not its three views
        ((8, 16), True),
        ((16, 16), True),
        ((8, 16), True),
        ((16, 40), False),  # the tied head, sampled rows only
    ]
    unfused = model_linear_weights(TinyRuntime(layers=1, fuse=False), LINEAR)
    assert [w.shape for w in unfused] == [(16, 8), (16, 4), (16, 4), (8, 16), (16, 40)]


def test_models_without_cpu_fp32_linear_layers_have_no_weights():
    assert model_linear_weights(SyntheticModel().runtime, LINEAR) == []
    half = TinyRuntime(layers=1).to(torch.bfloat16)
    assert model_linear_weights(half, LINEAR) == []


def test_weights_kept_in_their_stored_format_are_not_gemm_candidates():
    """Native (quantized / half) weights run on their own kernel: only the fp32 ones are timed here."""
    runtime = TinyRuntime(layers=1, fuse=False)
    block = runtime.blocks[0]
    _set_weight(block.o, QuantizedWeight.from_half(block.o.weight.detach().to(torch.float16)))
    assert [w.shape for w in model_linear_weights(runtime, LINEAR)] == [(16, 8), (16, 4), (16, 4), (16, 40)]


@pytest.mark.parametrize(
    "args, decode, prefill",
    [
        ((16, 2048), (1, 2, 4, 8, 16, 32), (128, 512, 2048)),  # shared with (32, 2048)
        ((32, 2048), (1, 2, 4, 8, 16, 32), (128, 512, 2048)),
        ((48, 2048, 300), (1, 2, 4, 8, 16, 32, 48), (192, 300, 768, 2048)),
        ((7, 20), (1, 2, 4, 7, 8, 16, 32), ()),
        ((1, 1), (1, 2, 4, 8, 16, 32), ()),
        ((64, 64), (1, 2, 4, 8, 16, 32, 64), ()),
    ],
)
def test_engine_row_counts(args, decode, prefill):
    assert engine_row_counts(*args) == RowCounts(decode, prefill)


def test_row_counts_validation():
    with pytest.raises(ValueError, match="decode must be ascending"):
        RowCounts((2, 1), ())
    with pytest.raises(ValueError, match="must lie above decode"):
        RowCounts((1, 8), (8,))


def test_a_prefill_pass_keeps_to_the_decode_budget_with_every_shape_once():
    weights = _weights()
    counts = RowCounts((1,), (64,))
    assert pass_weights(weights, 1, counts) == [w.weight for w in weights]
    chosen = pass_weights(weights, 64, counts)
    assert [tuple(w.shape) for w in chosen] == [(16, 16), (16, 8)]  # one per per-token shape, no head
    wide = pass_weights(weights, 2, RowCounts((1,), (2,)))  # budget of 1 row: still one of each shape
    assert [tuple(w.shape) for w in wide] == [(16, 16), (16, 8)]


# -- the table and its reasons ---------------------------------------------------------------------------


def test_table_and_reasons_follow_the_fastest_per_row_count():
    timings = FakeMeasure()(None, COUNTS)
    table = derive_table(timings)
    assert table == GemmTable(buckets=(RowBucket(2, NATIVE), RowBucket(4, BLAS)), default=TORCH)
    assert explain_table(timings) == [
        "rows 1-1 (measured at 1): native 1.0 GFLOP/s; openblas 0.5 (0.50x); torch 0.3 (0.33x)",
        "rows 2-2 (measured at 2): native 0.7 GFLOP/s; openblas 0.5 (0.75x); torch 0.3 (0.50x)",
        "rows 3-4 (measured at 4): openblas 1.0 GFLOP/s; native 0.5 (0.50x); torch 0.3 (0.33x)",
        "rows 5-16 (measured at 16): torch 1.0 GFLOP/s; openblas 0.5 (0.50x); native 0.2 (0.25x)",
        "rows above 16: as at 16",
    ]


def test_equal_times_go_to_torch():
    assert derive_table([PassTiming(1, 1.0, {BLAS: 1.0, TORCH: 1.0})]) == TORCH_ONLY


# -- the cache: keying, invalidation, round trip ---------------------------------------------------------


def _entries(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "gemm").glob("table-*.json"))


def test_a_calibration_round_trips_through_its_cache_entry(tmp_path, monkeypatch):
    measure = FakeMeasure()
    first = gemm_tune.calibrate(_weights(), COUNTS, measure=measure)
    assert first.source == "measured" and measure.calls == 1
    monkeypatch.setattr(gemm_tune, "_memo", {})  # a new process
    again = gemm_tune.calibrate(_weights(), COUNTS, measure=measure)
    (entry,) = _entries(tmp_path)
    assert measure.calls == 1 and again.source == f"cache {entry}"
    assert (again.table, again.reasons, again.timings, again.key) == (
        first.table,
        first.reasons,
        first.timings,
        first.key,
    )
    assert json.loads(entry.read_text())["table"] == first.table.describe()


def test_within_a_process_a_key_is_measured_or_read_once(tmp_path):
    measure = FakeMeasure()
    first = gemm_tune.calibrate(_weights(), COUNTS, measure=measure)
    for entry in _entries(tmp_path):
        entry.unlink()
    assert gemm_tune.calibrate(_weights(), COUNTS, measure=measure) is first and measure.calls == 1
    gemm_tune.calibrate(_weights(), COUNTS, measure=measure, refresh=True)
    assert measure.calls == 2 and len(_entries(tmp_path)) == 1


KEY_CHANGES = {
    "cpu model": lambda mp: mp.setattr(gemm_tune, "cpu_model", lambda: "Another CPU"),
    "cpu flags": lambda mp: mp.setattr(gemm_tune, "cpu_flags", lambda: (*cpu_info.cpu_flags(), "newflag")),
    "torch threads": lambda mp: mp.setattr(
        gemm_tune, "current_thread_settings", lambda: ThreadSettings(2, 99, 2, "libopenblas.so", "Haswell")
    ),
    "blas library": lambda mp: mp.setattr(
        gemm_tune, "current_thread_settings", lambda: ThreadSettings(2, 2, 2, "/x/libother.so", "Zen")
    ),
    "torch version": lambda mp: mp.setattr(torch, "__version__", "0.0.1"),
    "numpy version": lambda mp: mp.setattr(np, "__version__", "0.0.1"),
    "native kernels": lambda mp: mp.setattr(
        gemm_tune, "native_status", lambda: NativeStatus(False, "disabled by PAGEDGEN_NATIVE_KERNELS")
    ),
    "method": lambda mp: mp.setattr(gemm_tune, "METHOD_VERSION", gemm_tune.METHOD_VERSION + 1),
}


@pytest.mark.parametrize("change", list(KEY_CHANGES), ids=list(KEY_CHANGES))
def test_changing_any_key_component_measures_a_new_entry(change, monkeypatch, tmp_path):
    measure = FakeMeasure()
    gemm_tune.calibrate(_weights(), COUNTS, measure=measure)
    KEY_CHANGES[change](monkeypatch)
    monkeypatch.setattr(gemm_tune, "_memo", {})
    gemm_tune.calibrate(_weights(), COUNTS, measure=measure)
    assert measure.calls == 2 and len(_entries(tmp_path)) == 2


def test_other_shapes_or_row_counts_are_new_entries(tmp_path):
    measure = FakeMeasure()
    gemm_tune.calibrate(_weights(), COUNTS, measure=measure)
    gemm_tune.calibrate(_weights()[:2], COUNTS, measure=measure)
    gemm_tune.calibrate(_weights(), RowCounts((1, 2, 4), (16,)), measure=measure)  # same: a memo hit
    gemm_tune.calibrate(_weights(), RowCounts((1, 2), (16,)), measure=measure)
    assert measure.calls == 3 and len(_entries(tmp_path)) == 3


@pytest.mark.parametrize(
    "damage",
    [
        lambda text: text[: len(text) // 2],  # truncated
        lambda text: "",
        lambda text: json.dumps({"key": json.loads(text)["key"], "timings": []}),  # no timings
        lambda text: text.replace('"torch":', '"cuBLAS":'),  # unknown backend
        lambda text: json.dumps(json.loads(text) | {"key": {"cpu": "elsewhere"}}),  # another key
    ],
    ids=["truncated", "empty", "no-timings", "unknown-backend", "other-key"],
)
def test_a_corrupt_or_foreign_entry_is_measured_again_and_rewritten(damage, monkeypatch, tmp_path):
    measure = FakeMeasure()
    first = gemm_tune.calibrate(_weights(), COUNTS, measure=measure)
    (entry,) = _entries(tmp_path)
    good = entry.read_text()
    entry.write_text(damage(good))
    monkeypatch.setattr(gemm_tune, "_memo", {})
    again = gemm_tune.calibrate(_weights(), COUNTS, measure=measure)
    assert measure.calls == 2 and again.source == "measured" and again.table == first.table
    assert json.loads(entry.read_text()) == json.loads(good)


# -- installing: pinned tables, the environment, models without linear layers ---------------------------


def test_adapt_installs_the_measured_table_unless_one_is_pinned():
    measure = FakeMeasure()
    chosen = gemm_tune.adapt_to_model(TinyRuntime(), LINEAR, 4, 16, measure=measure)
    assert chosen is not None and gemm.active_table() == chosen.table == derive_table(measure(None, COUNTS))
    set_gemm_table(OPENBLAS_ONLY)  # pinned
    assert gemm_tune.adapt_to_model(TinyRuntime(), LINEAR, 4, 16, measure=measure) is None
    assert gemm.active_table() is OPENBLAS_ONLY and measure.calls == 2  # the pinned check measures nothing
    assert not adopt_table(TORCH_ONLY) and gemm.active_table() is OPENBLAS_ONLY


def test_a_scoped_table_restores_the_unpinned_state():
    with use_gemm_table(NATIVE_ONLY):
        assert gemm.table_pinned()
    assert not gemm.table_pinned() and adopt_table(OPENBLAS_ONLY)


def test_models_without_linear_layers_keep_the_table():
    measure = FakeMeasure()
    assert gemm_tune.adapt_to_model(SyntheticModel().runtime, LINEAR, 16, 2048, measure=measure) is None
    assert measure.calls == 0 and gemm.active_table() is UNTUNED


@pytest.mark.parametrize(
    "name, table", [("torch", TORCH_ONLY), ("openblas", OPENBLAS_ONLY), ("native", NATIVE_ONLY)]
)
def test_the_environment_names_one_backend(name, table, monkeypatch):
    monkeypatch.setenv(gemm_tune.TABLE_ENV, name)
    measure = FakeMeasure()
    chosen = gemm_tune.adapt_to_model(TinyRuntime(), LINEAR, 4, 16, measure=measure)
    assert chosen is not None and chosen.source == f"PAGEDGEN_GEMM_TABLE={name}"
    assert gemm.active_table() is table and measure.calls == 0


def test_the_environment_names_a_table_file(monkeypatch, tmp_path):
    gemm_tune.calibrate(_weights(), COUNTS, measure=FakeMeasure())
    (entry,) = _entries(tmp_path)
    monkeypatch.setenv(gemm_tune.TABLE_ENV, str(entry))
    chosen = gemm_tune.adapt_to_model(SyntheticModel().runtime, LINEAR, 16, 2048, measure=FakeMeasure())
    assert chosen is not None and gemm.active_table() == derive_table(FakeMeasure()(None, COUNTS))
    monkeypatch.setenv(gemm_tune.TABLE_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="PAGEDGEN_GEMM_TABLE="):
        gemm_tune.adapt_to_model(TinyRuntime(), LINEAR, 4, 16)


# -- real measurements on tiny weights ---------------------------------------------------------------------


def test_without_the_native_kernel_the_candidates_are_torch_and_openblas(monkeypatch):
    monkeypatch.setattr(gemm_calibrate, "gemm_kernel", lambda: None)
    timings = time_passes(_weights(), RowCounts((1, 2), (8,)), max_rounds=2)
    assert [t.rows for t in timings] == [1, 2, 8]
    assert all(set(t.seconds) == {TORCH, BLAS} and min(t.seconds.values()) > 0 for t in timings)
    assert NATIVE not in {b.backend for b in derive_table(timings).buckets} | {derive_table(timings).default}


def test_an_engine_without_a_compiler_measures_torch_and_openblas(tmp_path):
    """A fresh process with native kernels off: the engine on a real (tiny) model picks from the two."""
    script = """
import json, sys, torch
import pagedgen as pg
from pagedgen.ops.matmul import gemm, gemm_tune
from tests.helpers.linear import TinyRuntime

class Model(pg.models.synthetic.SyntheticModel):
    runtime = TinyRuntime()

engine = pg.Engine(Model(), pg.EngineConfig(max_batch_size=4, max_scheduled_tokens=16, num_blocks=8))
(calibration,) = gemm_tune._memo.values()
print(json.dumps([sorted(b.value for b in t.seconds) for t in calibration.timings]))
print(gemm.active_table() == calibration.table, calibration.key["native"])
"""
    env = {"PAGEDGEN_NATIVE_KERNELS": "0", "PAGEDGEN_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=root,
        env=env | {"PYTHONPATH": str(root)},
    )
    assert result.returncode == 0, result.stderr
    backends, verdict = result.stdout.strip().splitlines()
    assert json.loads(backends) == [["openblas", "torch"]] * 6  # rows 1, 2, 4, 8, 16, 32
    assert verdict == "True off: disabled by PAGEDGEN_NATIVE_KERNELS"
    assert len(list((tmp_path / "gemm").glob("table-*.json"))) == 1


def test_bench_gemm_prints_the_table_and_a_reason_per_row_count(monkeypatch, capsys, tmp_path):
    from pagedgen.bench import cli

    class StubModel:
        def __init__(self, name, dtype, device, weights):
            self.runtime = TinyRuntime()

    seen, real = [], gemm_tune.calibrate

    def calibrate(weights, counts, quant_weights=(), refresh=False):
        seen.append((counts, refresh))
        return real(weights, counts, measure=FakeMeasure(), refresh=refresh)

    monkeypatch.setattr("pagedgen.models.model.Model", StubModel)
    monkeypatch.setattr(gemm_tune, "calibrate", calibrate)
    out_json = tmp_path / "gemm.json"
    argv = ["gemm", "--max-batch-size", "4", "--max-scheduled-tokens", "64", "--recalibrate", "--json"]
    assert cli.main([*argv, str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert seen == [(RowCounts((1, 2, 4, 8, 16, 32), (64,)), True)]
    assert "table: rows<=2: native; rows<=4: openblas; else torch\n" in printed
    assert (
        "  rows 3-4 (measured at 4): openblas 1.0 GFLOP/s; native 0.5 (0.50x); torch 0.3 (0.33x)\n" in printed
    )
    assert ", ".join(cpu_info.cpu_features()) in printed
    document = json.loads(out_json.read_text())
    assert document["calibration"]["table"] == "rows<=2: native; rows<=4: openblas; else torch"
    assert document["cpu_features"] == list(cpu_info.cpu_features())


# -- weights kept in their stored format: the quantized paths --------------------------------------------


class MixedRuntime(TinyRuntime):
    """TinyRuntime's fp32 layers plus QuantRuntime's quantized ones (its Q8_0 head replaces the fp32 one)."""

    def __init__(self):
        super().__init__()
        self.quant = QuantRuntime()

    @property
    def head_weight(self):
        return self.quant.head_weight


def _quant_weights(runtime=None):
    return model_quant_weights(runtime or QuantRuntime(), LINEAR)


def test_quantized_timings_round_trip_through_the_cache_entry(tmp_path, monkeypatch):
    measure, measure_quant = FakeMeasure(), FakeQuantMeasure()
    runtime = MixedRuntime()
    args = (model_linear_weights(runtime, LINEAR), COUNTS)
    first = gemm_tune.calibrate(*args, quant_weights=_quant_weights(runtime), measure_quant=measure_quant)
    assert first.quant == derive_quant_table(first.quant_timings) and first.table is not None
    assert first.key["quant_shapes"] == {"Q4_1 32->64": 2, "Q4_1 32->32": 2, "Q8_0 32->40 head": 1}
    monkeypatch.setattr(gemm_tune, "_memo", {})
    again = gemm_tune.calibrate(
        *args, quant_weights=_quant_weights(runtime), measure=measure, measure_quant=measure_quant
    )
    assert measure_quant.calls == 1 and measure.calls == 0 and again.source.startswith("cache ")
    assert (again.quant, again.quant_reasons, again.quant_timings) == (
        first.quant,
        first.quant_reasons,
        first.quant_timings,
    )
    (entry,) = _entries(tmp_path)
    assert json.loads(entry.read_text())["quant_table"] == first.quant.describe()


def test_a_model_on_native_weights_measures_only_the_quantized_paths():
    measure, measure_quant = FakeMeasure(), FakeQuantMeasure()
    weights = model_linear_weights(QuantRuntime(), LINEAR)
    calibration = gemm_tune.calibrate(
        weights, COUNTS, quant_weights=_quant_weights(), measure=measure, measure_quant=measure_quant
    )
    assert weights == [] and measure.calls == 0 and measure_quant.calls == 1
    assert calibration.table is None and calibration.reasons == () and calibration.quant is not None
    assert calibration.quant.select(QType.Q4_1, (64, 32), 2) is KERNEL
    assert calibration.quant.select(QType.Q4_1, (64, 32), 3) is DEQUANT


def _other_qtype() -> list:
    weights = _quant_weights()
    head = weights[-1].weight
    return [
        *weights[:-1],
        type(weights[-1])(QuantizedWeight.from_half(torch.zeros(head.shape, dtype=torch.float16)), False),
    ]


QUANT_CHANGES = {
    "fewer layers": lambda: _quant_weights(QuantRuntime(layers=1)),
    "other shapes": lambda: _quant_weights(QuantRuntime(fuse=False)),
    "other format": _other_qtype,  # the head as f16 instead of Q8_0, same shape
    "none": lambda: [],
}


@pytest.mark.parametrize("change", list(QUANT_CHANGES), ids=list(QUANT_CHANGES))
def test_other_quantized_kinds_or_counts_are_new_entries(change, tmp_path):
    measure, measure_quant = FakeMeasure(), FakeQuantMeasure()
    gemm_tune.calibrate(
        _weights(), COUNTS, quant_weights=_quant_weights(), measure=measure, measure_quant=measure_quant
    )
    gemm_tune.calibrate(
        _weights(), COUNTS, quant_weights=_quant_weights(), measure=measure, measure_quant=measure_quant
    )
    assert len(_entries(tmp_path)) == 1  # the same kinds: a memo hit
    changed = QUANT_CHANGES[change]()
    gemm_tune.calibrate(
        _weights(), COUNTS, quant_weights=changed, measure=measure, measure_quant=measure_quant
    )
    assert len(_entries(tmp_path)) == 2 and measure.calls == 2
    assert measure_quant.calls == (1 if change == "none" else 2)


def test_an_entry_from_before_the_quantized_paths_is_measured_again(tmp_path):
    """A method-1 entry (fp32 timings only, no quantized shapes in its key) found where the new key's entry
    goes is not read: the method version in the key changed."""
    measure, measure_quant = FakeMeasure(), FakeQuantMeasure()
    key = gemm_tune.calibration_key(_weights(), COUNTS, _quant_weights())
    assert key["method"] == 3
    old_key = {k: v for k, v in key.items() if k != "quant_shapes"} | {"method": 1}
    path = gemm_tune.cache_dir() / f"table-{gemm_tune.key_digest(key)}.json"
    path.parent.mkdir(parents=True)
    timings = [{"rows": 1, "flops": 1e9, "seconds": {"torch": 1.0}}]
    path.write_text(json.dumps({"key": old_key, "table": "else torch", "timings": timings}))
    found = gemm_tune.calibrate(
        _weights(), COUNTS, quant_weights=_quant_weights(), measure=measure, measure_quant=measure_quant
    )
    assert found.source == "measured" and (measure.calls, measure_quant.calls) == (1, 1)
    assert json.loads(path.read_text())["key"] == key


@pytest.mark.parametrize(
    "damage",
    [
        lambda doc: doc | {"quant_timings": []},
        lambda doc: doc | {"quant_timings": [t | {"qtype": "Q9_9"} for t in doc["quant_timings"]]},
        lambda doc: doc | {"quant_timings": [t | {"seconds": {"kernel": 0.0}} for t in doc["quant_timings"]]},
        lambda doc: doc | {"quant_timings": [t | {"shape": [4]} for t in doc["quant_timings"]]},
    ],
    ids=["no-quant-timings", "unknown-format", "zero-time", "bad-shape"],
)
def test_a_damaged_quantized_part_is_measured_again(damage, monkeypatch, tmp_path):
    measure_quant = FakeQuantMeasure()
    first = gemm_tune.calibrate([], COUNTS, quant_weights=_quant_weights(), measure_quant=measure_quant)
    (entry,) = _entries(tmp_path)
    entry.write_text(json.dumps(damage(json.loads(entry.read_text()))))
    monkeypatch.setattr(gemm_tune, "_memo", {})
    again = gemm_tune.calibrate([], COUNTS, quant_weights=_quant_weights(), measure_quant=measure_quant)
    assert measure_quant.calls == 2 and again.source == "measured" and again.quant == first.quant


def test_adapt_installs_the_quantized_table_and_leaves_the_gemm_table(monkeypatch):
    monkeypatch.setattr(gemm_tune, "quant_kernels", lambda: object())
    measure, measure_quant = FakeMeasure(), FakeQuantMeasure()
    chosen = gemm_tune.adapt_to_model(
        QuantRuntime(), LINEAR, 4, 16, measure=measure, measure_quant=measure_quant
    )
    assert chosen is not None and chosen.table is None and measure.calls == 0
    assert active_quant_table() == chosen.quant and gemm.active_table() is UNTUNED
    assert active_quant_table().select(QType.Q8_0, (40, 32), 2) is KERNEL


def test_a_pinned_table_stands_while_the_other_is_measured(monkeypatch):
    monkeypatch.setattr(gemm_tune, "quant_kernels", lambda: object())
    measure, measure_quant = FakeMeasure(), FakeQuantMeasure()
    set_quant_table(DEQUANT_ONLY)  # pinned
    chosen = gemm_tune.adapt_to_model(
        MixedRuntime(), LINEAR, 4, 16, measure=measure, measure_quant=measure_quant
    )
    assert chosen is not None and chosen.quant is None and measure_quant.calls == 0
    assert gemm.active_table() == chosen.table and active_quant_table() is DEQUANT_ONLY
    set_gemm_table(TORCH_ONLY)  # both pinned: nothing is measured
    assert gemm_tune.adapt_to_model(MixedRuntime(), LINEAR, 4, 16, measure=measure) is None
    assert measure.calls == 1


def test_without_the_native_kernels_the_quantized_paths_are_not_measured(monkeypatch):
    monkeypatch.setattr(gemm_tune, "quant_kernels", lambda: None)
    measure_quant = FakeQuantMeasure()
    assert gemm_tune.adapt_to_model(QuantRuntime(), LINEAR, 4, 16, measure_quant=measure_quant) is None
    assert measure_quant.calls == 0 and active_quant_table() is UNCALIBRATED


@pytest.mark.parametrize(
    "name, quant", [("torch", DEQUANT_ONLY), ("openblas", DEQUANT_ONLY), ("native", KERNEL_ONLY)]
)
def test_the_environment_maps_each_backend_name_to_a_quantized_path(name, quant, monkeypatch):
    monkeypatch.setenv(gemm_tune.TABLE_ENV, name)
    measure_quant = FakeQuantMeasure()
    chosen = gemm_tune.adapt_to_model(QuantRuntime(), LINEAR, 4, 16, measure_quant=measure_quant)
    assert chosen is not None and chosen.quant is quant and active_quant_table() is quant
    assert measure_quant.calls == 0
    assert chosen.quant_reasons == (f"{quant.default.value} for every call (PAGEDGEN_GEMM_TABLE={name})",)


def test_the_environment_names_a_table_file_with_quantized_timings(monkeypatch, tmp_path):
    measured = gemm_tune.calibrate(
        [], COUNTS, quant_weights=_quant_weights(), measure_quant=FakeQuantMeasure()
    )
    (entry,) = _entries(tmp_path)
    monkeypatch.setenv(gemm_tune.TABLE_ENV, str(entry))
    chosen = gemm_tune.adapt_to_model(SyntheticModel().runtime, LINEAR, 16, 2048)
    assert chosen is not None and chosen.source == f"PAGEDGEN_GEMM_TABLE={entry}"
    assert active_quant_table() == measured.quant and gemm.active_table() is UNTUNED


def test_bench_gemm_prints_the_quantized_table_and_its_reasons(monkeypatch, capsys, tmp_path):
    from pagedgen.bench import cli
    from pagedgen.ops.matmul import quant_gemm

    class StubModel:
        def __init__(self, name, dtype, device, weights):
            assert weights == "native"
            self.runtime = QuantRuntime()

    real = gemm_tune.calibrate

    def calibrate(weights, counts, quant_weights=(), refresh=False):
        return real(weights, counts, quant_weights=quant_weights, measure_quant=FakeQuantMeasure())

    monkeypatch.setattr("pagedgen.models.model.Model", StubModel)
    monkeypatch.setattr(gemm_tune, "calibrate", calibrate)
    monkeypatch.setattr(quant_gemm, "quant_kernels", lambda: object())
    out_json = tmp_path / "gemm.json"
    assert (
        cli.main(["gemm", "--max-batch-size", "4", "--max-scheduled-tokens", "64", "--json", str(out_json)])
        == 0
    )
    printed = capsys.readouterr().out
    assert "\ntable:" not in printed  # no fp32 linear layers
    table = (
        "rows<=2: kernel; else dequant; Q4_1 32->64: [<=2: kernel, else dequant]; "
        "Q4_1 32->32: [<=2: kernel, else dequant]; Q8_0 32->40: [<=2: kernel, else dequant]"
    )
    assert f"quantized table: {table}\n" in printed
    assert "  Q8_0 32->40: kernel up to 2 rows\n" in printed
    assert "    rows 3-4 (measured at 4): dequant 2.0 GFLOP/s; kernel 1.0 (0.50x)\n" in printed
    document = json.loads(out_json.read_text())
    assert document["calibration"]["quant_table"] == table and document["calibration"]["table"] is None
