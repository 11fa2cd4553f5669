"""The prepared device check and ``bench throughput --random-weights`` run on the CPU at tiny sizes.

Why here: a GPU session has minutes of device time, so ``scripts/gpu_check.py`` must be known to work before
one starts. These tests run it end to end on a tiny random config (smoke sizes), and check its JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedgen.bench import cli as bench_cli

pytestmark = pytest.mark.model  # imports transformers

ROOT = Path(__file__).resolve().parents[2]
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 0,
    "eos_token_id": 0,
}


@pytest.fixture
def config_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "config"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(TINY_CONFIG))
    return directory


def test_the_gpu_check_runs_on_the_cpu_in_smoke_sizes(config_dir: Path, tmp_path: Path):
    out = tmp_path / "gpu_check.json"
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--smoke", "--device", "cpu"]
    command += ["--config", str(config_dir), "--out", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    document = json.loads(out.read_text())
    assert document["environment"]["device"] == "cpu" and document["dtype"] == "bfloat16"
    for name in ("W1", "batch1", "wide256"):
        section = document[name]
        assert "error" not in section, section
        assert section["pagedgen"]["tok_s"] > 0 and section["transformers_static"]["tok_s"] > 0
        assert section["greedy_match_vs_transformers"]["compared_tokens"] == section["output_tokens"]
    decode = document["decode_step"]
    assert "error" not in decode and decode["median_step_ms"] > 0 and decode["graphs"] is None  # CPU
    assert "error" not in decode["profile"], decode["profile"]
    fp32 = document["fp32_greedy_match"]
    assert fp32["rate"] == 1.0 and fp32["compared_tokens"] == 2 * 6, fp32


def test_bench_throughput_runs_on_random_weights(config_dir: Path, tmp_path: Path, capsys):
    out = tmp_path / "bench.json"
    argv = ["throughput", "--device", "cpu", "--random-weights", str(config_dir), "--num-prompts", "2"]
    argv += ["--input-len", "6", "--output-len", "4", "--max-batch-size", "2", "--no-roofline"]
    argv += ["--baselines", "hf-static", "--json", str(out)]  # baselines run only on request
    assert bench_cli.main(argv) == 0
    document = json.loads(out.read_text())
    assert document["machine"]["device"] == "cpu" and document["machine"]["dtype"] == "float32"
    systems = {r["system"]: r for r in document["records"]}
    assert systems["hf-static"]["status"] == "ok" and systems["hf-static"]["match_rate"] == 1.0
    assert systems["pagedgen"]["status"] == "ok"


def test_random_weights_are_seeded(config_dir: Path, tmp_path: Path):
    from safetensors.torch import load_file

    from pagedgen.bench.random_weights import random_checkpoint

    a = load_file(random_checkpoint(config_dir, tmp_path / "a", seed=1) / "model.safetensors")
    b = load_file(random_checkpoint(config_dir, tmp_path / "b", seed=1) / "model.safetensors")
    c = load_file(random_checkpoint(config_dir, tmp_path / "c", seed=2) / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    assert not (a[name] == c[name]).all()


def test_random_weights_need_a_config(tmp_path: Path):
    from pagedgen.bench.random_weights import random_checkpoint

    with pytest.raises(ValueError, match="no config.json"):
        random_checkpoint(tmp_path, tmp_path / "out")
