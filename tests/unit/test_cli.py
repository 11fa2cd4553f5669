"""The ``pagedgen`` command line: argument parsing, engine/sampling mapping, bench dispatch, ``generate``."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest

import pagedgen as pg
from pagedgen import cli
from pagedgen.models.synthetic import SyntheticModel, SyntheticTokenizer, synthetic_greedy


def test_serve_defaults_bind_to_localhost_8000():
    args = cli.build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.model, args.weights) == ("127.0.0.1", 8000, "default", "native")
    assert args.served_model_name is None
    assert cli.engine_config(args) == pg.EngineConfig()


def test_weights_choose_native_or_float32_and_refuse_the_rest(capsys):
    parser = cli.build_parser()
    assert parser.parse_args(["generate", "hi", "--weights", "float32"]).weights == "float32"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--weights", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err


def test_engine_options_map_to_the_engine_config():
    args = cli.build_parser().parse_args(
        [
            "serve",
            "--max-batch-size",
            "4",
            "--max-scheduled-tokens",
            "512",
            "--block-size",
            "32",
            "--num-blocks",
            "100",
            "--chunk-size",
            "64",
            "--max-mixed-step-tokens",
            "128",
            "--static-batching",
        ]
    )
    assert cli.engine_config(args) == pg.EngineConfig(
        max_batch_size=4,
        max_scheduled_tokens=512,
        block_size=32,
        num_blocks=100,
        chunk_size=64,
        max_mixed_step_tokens=128,
        dynamic_batching=False,
    )
    defaults = cli.engine_config(cli.build_parser().parse_args(["serve"]))
    assert defaults == pg.EngineConfig() and defaults.max_mixed_step_tokens is None  # the device decides


def test_sampling_options_map_to_sampling_params():
    args = cli.build_parser().parse_args(
        ["generate", "hi", "--max-tokens", "7", "--temperature", "0.5", "--top-k", "3", "--seed", "9"]
        + ["--stop", "\n", "--stop", "END", "--ignore-eos"]
    )
    params = cli.sampling_params(args)
    assert params == pg.SamplingParams(
        max_tokens=7, temperature=0.5, top_k=3, seed=9, stop=("\n", "END"), ignore_eos=True
    )
    default = cli.sampling_params(cli.build_parser().parse_args(["generate", "hi"]))
    assert default.temperature == 0.0  # the command line is greedy unless asked otherwise


@pytest.mark.parametrize("argv", [["--port", "http"], ["--max-batch-size", "-1"], ["--num-blocks", "x"]])
def test_bad_arguments_exit_with_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", *argv])
    assert info.value.code == 2
    assert "usage:" in capsys.readouterr().err


@pytest.mark.parametrize("command", [[], ["serve"], ["generate"], ["chat"]])
def test_help_for_every_command(command):
    result = subprocess.run(
        [sys.executable, "-m", "pagedgen.cli", *command, "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0
    assert result.stdout.startswith("usage: pagedgen")
    assert "torch" not in result.stderr


def test_bench_dispatches_to_the_bench_module(monkeypatch):
    calls = []
    module = types.SimpleNamespace(main=lambda argv: calls.append(argv) or 3)
    monkeypatch.setattr(cli.importlib, "import_module", lambda name: module)
    assert cli.main(["bench", "throughput", "--json", "x.json"]) == 3
    assert calls == [["throughput", "--json", "x.json"]]


def test_bench_reports_when_unavailable(monkeypatch, capsys):
    def missing(name):
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(cli.importlib, "import_module", missing)
    assert cli.main(["bench", "throughput"]) == 2
    assert "unavailable" in capsys.readouterr().err


def test_generate_prints_one_json_record_per_prompt(monkeypatch, capsys):
    vocab = 95
    monkeypatch.setattr(cli, "_load_model", lambda name, weights: SyntheticModel(vocab_size=vocab))
    assert cli.main(["generate", "abc", "hello", "--max-tokens", "5", "--num-blocks", "16", "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    tokenizer = SyntheticTokenizer(vocab)
    assert [r["prompt"] for r in records] == ["abc", "hello"]
    for record in records:
        expected = synthetic_greedy(tokenizer.encode(record["prompt"]), 5, vocab)
        assert record["token_ids"] == expected
        assert record["text"] == tokenizer.decode(expected)
        assert record["finish_reason"] == "length"
        assert record["prompt_tokens"] == len(record["prompt"])


def test_generate_with_ngram_speculation_prints_the_same_tokens_and_its_drafts(monkeypatch, capsys):
    vocab = 13  # a small vocabulary: the synthetic output repeats bigrams, so prompt lookup proposes
    monkeypatch.setattr(cli, "_load_model", lambda name, weights: SyntheticModel(vocab_size=vocab))
    argv = ["generate", "abcab", "--max-tokens", "30", "--num-blocks", "16", "--json"]
    assert cli.main([*argv, "--speculative", "ngram", "--num-speculative-tokens", "3"]) == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    tokenizer = SyntheticTokenizer(vocab)
    assert record["token_ids"] == synthetic_greedy(tokenizer.encode("abcab"), 30, vocab)
    assert record["drafts_proposed"] > 0 and 0 <= record["drafts_accepted"] <= record["drafts_proposed"]


def test_generate_plain_output_is_the_completion_text(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_load_model", lambda name, weights: SyntheticModel(vocab_size=95))
    assert cli.main(["generate", "abc", "--max-tokens", "3", "--num-blocks", "16"]) == 0
    tokenizer = SyntheticTokenizer(95)
    expected = tokenizer.decode(synthetic_greedy(tokenizer.encode("abc"), 3, 95))
    assert capsys.readouterr().out == expected + "\n"
