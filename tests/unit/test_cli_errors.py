"""A user's mistake on the ``pagedgen`` command line: one line on stderr, exit status 2, no traceback.

Every wrong model path a new user tries (missing, a hub id, a directory without config.json, a text file
named ``.gguf``, a truncated GGUF), an unknown flag (reported with the subcommand's usage), a busy port (found
before the model loads); ``--debug`` shows the traceback; ``--version``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pagedgen import cli
from tests.model.tiny_checkpoints import TINY_RAW, random_state, write_gguf


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDGEN_CACHE_DIR", str(tmp_path / "cache"))


def _truncated_gguf(tmp_path: Path) -> Path:
    whole = tmp_path / "whole.gguf"
    write_gguf(whole, "llama", random_state(TINY_RAW), TINY_RAW)
    data = whole.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) * 3 // 4])  # the header and metadata whole, the tensor data cut short
    return cut


def _bad_model(kind: str, tmp_path: Path) -> tuple[str, str]:
    """The --model value of a wrong path and the exact error it must print."""
    if kind == "missing":
        path = str(tmp_path / "nowhere")
        return path, f"{path}: model path not found (expected 'default', a checkpoint dir or a .gguf file)"
    if kind == "hub id":
        name = "HuggingFaceTB/SmolLM2-135M"  # run where no such directory exists (tmp_path)
        return name, f"{name}: model path not found (expected 'default', a checkpoint dir or a .gguf file)"
    if kind == "dir without config.json":
        (tmp_path / "empty").mkdir()
        return str(tmp_path / "empty"), f"{tmp_path / 'empty' / 'config.json'}: file not found"
    if kind == "text file named .gguf":
        fake = tmp_path / "fake.gguf"
        fake.write_text("hello\n")
        return str(fake), f"{fake}: not a GGUF file (magic b'hell', expected b'GGUF')"
    cut = _truncated_gguf(tmp_path)
    return str(cut), f"{cut}: truncated or corrupt GGUF file ("


KINDS = ["missing", "hub id", "dir without config.json", "text file named .gguf", "truncated GGUF"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_wrong_model_path_is_one_line_and_exit_2(kind, command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    model, message = _bad_model(kind, tmp_path)
    argv = [command, "hi", "--model", model] if command == "generate" else [command, "--model", model]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert lines[0] == f"loading model {model!r} (native weights) ..."
    assert len(lines) == 2 and lines[1].startswith(f"pagedgen {command}: error: {message}")
    if kind != "truncated GGUF":
        assert lines[1] == f"pagedgen {command}: error: {message}"
    assert captured.out == ""


def _run(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, "-m", "pagedgen.cli", *argv], capture_output=True, text=True, cwd=cwd, env=env
    )


def test_the_process_prints_no_traceback_and_debug_shows_it(tmp_path):
    missing = str(tmp_path / "nowhere")
    message = f"{missing}: model path not found (expected 'default', a checkpoint dir or a .gguf file)"
    plain = _run("generate", "hi", "--model", missing, cwd=tmp_path)
    assert plain.returncode == 2
    assert plain.stderr.splitlines()[1:] == [f"pagedgen generate: error: {message}"]
    assert "Traceback" not in plain.stderr

    for argv in (["--debug", "generate", "hi"], ["generate", "hi", "--debug"]):
        debug = _run(*argv, "--model", missing, cwd=tmp_path)
        assert debug.returncode == 1  # the exception escapes, as Python reports it
        assert "Traceback (most recent call last)" in debug.stderr
        assert debug.stderr.rstrip().endswith(f"pagedgen.errors.ModelLoadError: {message}")


@pytest.mark.parametrize("command", ["serve", "generate", "chat"])
def test_an_unknown_flag_shows_the_subcommands_usage(command, capsys):
    argv = [command, "--bogus", "1"] if command != "generate" else [command, "hi", "--bogus", "1"]
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: pagedgen {command} ")
    assert err.splitlines()[-1] == f"pagedgen {command}: error: unrecognized arguments: --bogus 1"


def test_version_prints_the_package_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"pagedgen {version('pagedgen')}\n"


def test_a_busy_port_fails_before_the_model_loads(tmp_path, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # A missing model too: the port is checked first, so the model is never looked at.
        code = cli.main(["serve", "--port", str(port), "--model", str(tmp_path / "nowhere")])
    assert code == 2
    assert capsys.readouterr().err == (
        f"pagedgen serve: error: cannot listen on 127.0.0.1:{port}: Address already in use\n"
    )


def test_an_unknown_host_fails_before_the_model_loads(tmp_path, capsys):
    code = cli.main(["serve", "--host", "no-such-host.invalid", "--model", str(tmp_path / "nowhere")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedgen serve: error: cannot listen on no-such-host.invalid:8000: ")
    assert err.count("\n") == 1 and "loading model" not in err


def test_a_free_port_passes_the_check():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cli.check_port_free("127.0.0.1", port)  # raises nothing
    cli.check_port_free("127.0.0.1", 0)  # any port: nothing to check
