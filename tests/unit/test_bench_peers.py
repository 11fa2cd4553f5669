"""The peer baselines' plumbing without the peers: the ONNX Runtime GenAI export cache (a fake model builder),
its batched run (a fake ``onnxruntime_genai``), the vLLM driver protocol (a stub ``vllm`` run by this
interpreter as the "venv" Python), the CPU flags and the ``bench`` extra's error messages."""

from __future__ import annotations

import importlib.machinery
import json
import sys
import types

import numpy as np
import pytest

import pagedgen.bench.ort_genai as ort_genai
from pagedgen.bench.checkpoints import hf_dir_for_loaders
from pagedgen.bench.cli import main
from pagedgen.bench.cpu import relevant_flags
from pagedgen.bench.extras import MissingBenchExtra, require
from pagedgen.bench.records import SystemSkipped
from pagedgen.bench.vllm_runner import Vllm, cores_in_use, cpu_list
from pagedgen.bench.workloads import BenchRequest

PAD = 2


def fake_greedy(prompt, n):
    """What every fake peer generates for an (unpadded) prompt: a function of the prompt alone."""
    return [(sum(prompt) + 7 * k) % 1000 for k in range(n)]


def requests_of(lengths, output_lens):
    return [
        BenchRequest(i, tuple(range(10 + i, 10 + i + n)), out)
        for i, (n, out) in enumerate(zip(lengths, output_lens, strict=True))
    ]


@pytest.fixture
def checkpoint(tmp_path):
    """An HF-style dir like pagedgen's GGUF cache entry: config.json without ``architectures``."""
    directory = tmp_path / "checkpoint"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 1000}))
    (directory / "model.safetensors").write_bytes(b"weights v1")
    (directory / "tokenizer.json").write_text("{}")
    return directory


# --- the export cache -------------------------------------------------------------------------------------

FAKE_BUILDER = """
import argparse, json, pathlib, sys
p = argparse.ArgumentParser()
for flag in ("-i", "-o", "-p", "-e", "-c"):
    p.add_argument(flag)
a = p.parse_args()
source = pathlib.Path(a.i)
config = json.loads((source / "config.json").read_text())
with open(sys.argv[0] + ".log", "a") as log:
    files = sorted(f.name for f in source.iterdir())
    log.write(json.dumps([a.p, a.e, config["architectures"], files]) + "\\n")
if (source / "model.safetensors").read_bytes() == b"broken":
    sys.exit("builder: cannot read the weights")
out = pathlib.Path(a.o)
out.mkdir(parents=True)
(out / "genai_config.json").write_text(json.dumps({"model": {"pad_token_id": 2}}))
"""


@pytest.fixture
def builder(tmp_path):
    script = tmp_path / "fake_builder.py"
    script.write_text(FAKE_BUILDER)
    log = tmp_path / "fake_builder.py.log"

    def builds():
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    return (sys.executable, str(script)), builds


def test_each_export_is_built_once_and_again_only_when_the_source_changes(tmp_path, checkpoint, builder):
    command, builds = builder
    root = tmp_path / "cache"
    fp32 = ort_genai.ensure_export(checkpoint, "fp32", root=root, builder=command)
    assert ort_genai.ensure_export(checkpoint, "fp32", root=root, builder=command) == fp32
    int4 = ort_genai.ensure_export(checkpoint, "int4", root=root, builder=command)
    files = ["config.json", "model.safetensors", "tokenizer.json"]
    assert builds() == [
        ["fp32", "cpu", ["LlamaForCausalLM"], files],
        ["int4", "cpu", ["LlamaForCausalLM"], files],
    ]
    assert fp32.parent == int4.parent == root / f"ort-genai-v{ort_genai.EXPORT_FORMAT}"
    assert fp32.name.startswith("fp32-cpu-") and int4.name.startswith("int4-cpu-")
    assert sorted(p.name for p in fp32.parent.iterdir()) == sorted([fp32.name, int4.name])  # no scratch left
    (checkpoint / "model.safetensors").write_bytes(b"weights v2")
    rebuilt = ort_genai.ensure_export(checkpoint, "fp32", root=root, builder=command)
    assert rebuilt != fp32 and len(builds()) == 3
    assert (rebuilt / "genai_config.json").is_file()


def test_a_failed_build_raises_with_the_builders_message_and_leaves_nothing(tmp_path, checkpoint, builder):
    command, _ = builder
    (checkpoint / "model.safetensors").write_bytes(b"broken")
    root = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="builder: cannot read the weights"):
        ort_genai.ensure_export(checkpoint, "fp32", root=root, builder=command)
    assert list((root / f"ort-genai-v{ort_genai.EXPORT_FORMAT}").iterdir()) == []


def test_loaders_never_see_pagedgens_native_weight_file(tmp_path, checkpoint):
    """vLLM loads every *.safetensors of the folder; a GGUF entry's raw blocks would be read as weights."""
    (checkpoint / "native.safetensors").write_bytes(b"raw blocks")
    staged = hf_dir_for_loaders(checkpoint, tmp_path / "staged")
    assert staged != checkpoint and not (staged / "native.safetensors").exists()
    assert (staged / "model.safetensors").resolve() == (checkpoint / "model.safetensors").resolve()
    assert json.loads((staged / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_loaders_get_the_checkpoint_itself_when_it_names_its_architecture(tmp_path, checkpoint):
    staged = hf_dir_for_loaders(checkpoint, tmp_path / "staged")
    assert json.loads((staged / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert (staged / "model.safetensors").resolve() == (checkpoint / "model.safetensors").resolve()
    assert hf_dir_for_loaders(staged, tmp_path / "unused") == staged
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "no-such-family"}))
    with pytest.raises(RuntimeError, match="no causal-LM class for model_type 'no-such-family'"):
        hf_dir_for_loaders(checkpoint, tmp_path / "other")


# --- the ONNX Runtime GenAI run ---------------------------------------------------------------------------


class FakeGenerator:
    """og.Generator's surface: right-padded prompts in, the padded rows plus generated tokens out."""

    def __init__(self, model, params):
        self.options = params.options
        model.calls.append(params.options)

    def append_tokens(self, ids):
        assert ids.dtype == np.int32 and ids.shape[0] == self.options["batch_size"]
        self.rows = ids.tolist()
        self.steps = 0

    def is_done(self):
        return len(self.rows[0]) + self.steps == self.options["max_length"]

    def generate_next_token(self):
        self.steps += 1

    def get_sequence(self, i):
        row = self.rows[i]
        prompt = row[: len(row) - next((k for k, t in enumerate(reversed(row)) if t != PAD), len(row))]
        return np.array(row + fake_greedy(prompt, self.steps), dtype=np.int32)


def fake_og():
    og = types.ModuleType("onnxruntime_genai")
    og.__spec__ = importlib.machinery.ModuleSpec("onnxruntime_genai", None)

    class Model:
        def __init__(self, path):
            self.path, self.calls = path, []

    class GeneratorParams:
        def __init__(self, model):
            self.options = {}

        def set_search_options(self, **options):
            self.options.update(options)

    og.Model, og.GeneratorParams, og.Generator = Model, GeneratorParams, FakeGenerator
    return og


def test_ort_genai_runs_mixed_prompt_lengths_in_right_padded_batches_of_up_to_32(
    monkeypatch, tmp_path, checkpoint
):
    export = tmp_path / "export"
    export.mkdir()
    (export / "genai_config.json").write_text(json.dumps({"model": {"pad_token_id": PAD}}))
    monkeypatch.setitem(sys.modules, "onnxruntime_genai", fake_og())
    monkeypatch.setattr(ort_genai, "ensure_export", lambda directory, precision: export)
    lengths = [3 + (i * 5) % 17 for i in range(70)]
    requests = requests_of(lengths, [1 + i % 9 for i in range(70)])
    runner = ort_genai.OrtGenai(checkpoint, "int4")
    run = runner.run(requests, 64)
    assert run.outputs == [fake_greedy(r.prompt_ids, r.output_len) for r in requests]
    calls = runner._model.calls
    assert [c["batch_size"] for c in calls] == [32, 32, 6]
    widths = [max(lengths[0:32]), max(lengths[32:64]), max(lengths[64:70])]
    longest = [max(r.output_len for r in requests[a : a + 32]) for a in (0, 32, 64)]
    assert [(c["max_length"], c["min_length"]) for c in calls] == [
        (w + n, w + n) for w, n in zip(widths, longest, strict=True)
    ]
    assert all(c["do_sample"] is False for c in calls)
    assert run.details["export"] == str(export) and run.details["batch_size"] == 32
    assert runner.run(requests[:2], 1).outputs == run.outputs[:2]  # the loaded model is reused


def test_right_padding_refuses_a_prompt_holding_the_pad_token():
    assert ort_genai.right_pad([(5, 6, 7), (8,)], PAD) == [[5, 6, 7], [8, PAD, PAD]]
    with pytest.raises(ValueError, match="prompt 1 contains og's pad token 2"):
        ort_genai.right_pad([(5,), (8, PAD)], PAD)


# --- the vLLM driver --------------------------------------------------------------------------------------

STUB_VLLM = """
import json, pathlib, types
import profile  # as torch._dynamo does (through cProfile): the standard library's, not pagedgen/bench's
assert "pagedgen" not in profile.__file__, profile.__file__
__version__ = "0.32.0-stub"
print("stub vllm imported")  # vLLM's chatter on stdout must not break the protocol


class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos):
        assert temperature == 0.0 and ignore_eos
        self.max_tokens = max_tokens


class LLM:
    def __init__(self, model, **kwargs):
        config = json.loads((pathlib.Path(model) / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"], config
        print("stub engine up")

    def generate(self, prompts, params, use_tqdm=True):
        def out(ids, n):
            return types.SimpleNamespace(token_ids=[(sum(ids) + 7 * k) % 1000 for k in range(n)])

        return [
            types.SimpleNamespace(outputs=[out(p["prompt_token_ids"], s.max_tokens)])
            for p, s in zip(prompts, params)
        ]
"""


def stub_package(tmp_path, source):
    """A stub ``vllm`` on a path where pagedgen is not importable, as in vLLM's own venv (a sitecustomize,
    which the interpreter imports from the path at start-up, blocks it)."""
    (tmp_path / "stub" / "vllm").mkdir(parents=True)
    (tmp_path / "stub" / "vllm" / "__init__.py").write_text(source)
    (tmp_path / "stub" / "sitecustomize.py").write_text("import sys\nsys.modules['pagedgen'] = None\n")
    return tmp_path / "stub"


def test_vllm_runs_through_the_driver_protocol_in_the_given_interpreter(monkeypatch, tmp_path, checkpoint):
    monkeypatch.setenv("PYTHONPATH", str(stub_package(tmp_path, STUB_VLLM)))
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    runner = Vllm(checkpoint, None, enforce_eager=True, threads=1)
    requests = requests_of([4, 9, 2], [3, 1, 5])
    try:
        run = runner.run(requests, 4)
        driver = runner._driver
        again = runner.run(requests[:1], 4)
    finally:
        runner.close()
    assert run.outputs == [fake_greedy(r.prompt_ids, r.output_len) for r in requests]
    assert again.outputs == run.outputs[:1] and runner._driver is None and driver is not None
    details = run.details
    assert details["python"] == sys.executable and details["vllm"] == "0.32.0-stub"
    assert details["threads_bind"] == cpu_list(cores_in_use(1))
    args = details["engine_args"]
    assert (args["dtype"], args["enforce_eager"], args["max_num_seqs"], args["seed"]) == (
        "float32",
        True,
        4,
        0,
    )
    assert args["gpu_memory_utilization"] == 0.3  # vLLM's CPU default (0.92 of the node) fails beside us


def test_vllm_is_skipped_when_its_interpreter_cannot_import_it(monkeypatch, tmp_path, checkpoint):
    monkeypatch.setenv("PYTHONPATH", str(stub_package(tmp_path, "raise ImportError('no vllm here')")))
    runner = Vllm(checkpoint, None, enforce_eager=False, threads=1)
    with pytest.raises(SystemSkipped, match=r"vllm is not importable by .*: no vllm here"):
        runner.run(requests_of([3], [2]), 2)
    missing = Vllm(checkpoint, tmp_path / "no-venv", enforce_eager=False, threads=1)
    with pytest.raises(SystemSkipped, match="no Python interpreter at .*no-venv/bin/python"):
        missing.run(requests_of([3], [2]), 2)


def test_vllm_binds_to_the_cores_in_use_as_a_cpu_list():
    assert cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert cpu_list([3]) == "3"
    with pytest.raises(ValueError, match="no cores"):
        cpu_list([])


# --- CPU flags and the bench extra ------------------------------------------------------------------------


def test_cpu_flags_keep_the_relevant_ones_in_a_fixed_order():
    flags = ["fpu", "avx2", "amx_tile", "sse4_2", "avx512_vnni", "fma", "avx512f", "amx_bf16"]
    assert relevant_flags(flags) == ["avx2", "fma", "avx512f", "avx512_vnni", "amx_bf16", "amx_tile"]
    assert relevant_flags([]) == []


def test_a_missing_module_of_the_extra_is_named_with_the_install_command(monkeypatch, tmp_path, capsys):
    with pytest.raises(MissingBenchExtra, match=r"the chart needs no_such_module_xyz, which the bench extra"):
        require("no_such_module_xyz", "the chart")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not importable
    monkeypatch.setitem(sys.modules, "httpx", None)
    common = ["--model", "synthetic", "--num-prompts", "2", "--input-len", "4", "--output-len", "2"]
    common += ["--baselines", "", "--no-roofline"]
    assert main(["throughput", *common, "--plot", str(tmp_path / "chart.png")]) == 1
    captured = capsys.readouterr()
    hint = "which the bench extra installs: pip install -e '.[bench]'"
    assert f"the throughput chart needs matplotlib, {hint}" in captured.err and captured.out == ""
    assert main(["throughput", *common, "--json", str(tmp_path / "bench.json")]) == 0
    assert "no chart: matplotlib is not installed" in capsys.readouterr().out
    assert (tmp_path / "bench.json").is_file() and not (tmp_path / "bench.png").exists()
    assert main(["serve", "--tokenizer", "synthetic"]) == 1
    assert f"pagedgen bench serve needs httpx, {hint}" in capsys.readouterr().err
