"""``pagedgen bench throughput``'s defaults, help and progress: pagedgen alone unless baselines or the float32
reference are asked for, the named workloads explained in ``--help``, a line per step as it goes."""

from __future__ import annotations

import json

import gguf
import pytest

from pagedgen.bench import cli as bench_cli
from pagedgen.bench.workloads import NAMED_WORKLOADS
from tests.model.tiny_checkpoints import TINY_RAW, random_state, write_gguf

SMALL = ["--num-prompts", "3", "--input-len", "4", "--output-len", "3", "--max-batch-size", "2"]


def test_help_explains_every_named_workload(capsys):
    with pytest.raises(SystemExit) as info:
        bench_cli.main(["throughput", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "named workloads (--workload):" in out
    for name, spec in NAMED_WORKLOADS.items():
        assert f"  {name}  {bench_cli.WORKLOAD_MEANINGS[name]}\n      {spec.describe()}\n" in out
    assert set(bench_cli.WORKLOAD_MEANINGS) == set(NAMED_WORKLOADS)


def test_a_plain_run_is_pagedgen_alone_with_progress_lines(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["throughput", "--model", "synthetic", *SMALL, "--no-roofline", "--json", str(out)]
    assert bench_cli.main(args) == 0
    records = json.loads(out.read_text())["records"]
    assert [(r["workload"], r["system"]) for r in records] == [("custom", "pagedgen")]
    lines = capsys.readouterr().out.splitlines()
    loading = lines.index("loading synthetic (native weights) ...")
    header = next(i for i, line in enumerate(lines) if line.startswith("[custom] 3 requests"))
    assert loading < header  # each step announced before it runs


def test_the_float32_reference_loads_only_on_request(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDGEN_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "llama", random_state(TINY_RAW), TINY_RAW)
    model, _, _, reference = bench_cli._load_model(str(path), "native")
    assert model.weights_format.value == "native" and reference is None
    _, _, _, reference = bench_cli._load_model(str(path), "native", reference=True)
    assert reference is not None and reference.weights_format.value == "float32"


def test_q8_activations_are_asked_for_and_the_reference_stays_exact(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDGEN_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny-q8_0.gguf"
    write_gguf(path, "llama", random_state(TINY_RAW), TINY_RAW, qtype=gguf.GGMLQuantizationType.Q8_0)
    model, _, _, reference = bench_cli._load_model(str(path), "native", activations="q8", reference=True)
    assert model.activations == "q8" and reference.activations == "fp32"
    assert bench_cli.device_info(model)["activations"] == "q8"
    parser = bench_cli.build_parser()
    assert parser.parse_args(["throughput"]).activations == "fp32"
    assert parser.parse_args(["throughput", "--activations", "q8"]).activations == "q8"
    assert parser.parse_args(["kernels", "--activations", "q8"]).activations == "q8"
    with pytest.raises(SystemExit):
        parser.parse_args(["throughput", "--activations", "int4"])


def test_the_defaults_ask_for_no_baseline_and_no_reference():
    args = bench_cli.build_parser().parse_args(["throughput"])
    assert (args.baselines, args.reference, args.workload) == ("", False, None)
    assert [spec.name for spec in bench_cli.workloads_from_args(args, "W1")] == ["W1"]
