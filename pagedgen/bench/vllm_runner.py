"""The ``vllm`` and ``vllm-eager`` baselines: vLLM's CPU build (fp32, compiled / eager) in its own venv.

vLLM pins its own torch, so it cannot share pagedgen's environment: the bench starts ``vllm_driver.py``
with the Python of the venv given by ``--vllm-venv`` (default: this interpreter) and talks to it in JSON
lines (the protocol is in that file). One driver process serves every workload of a run, so vLLM's start-up
and graph compilation happen once, in the untimed warm-up; only ``generate`` is timed, inside the driver.
``VLLM_CPU_OMP_THREADS_BIND`` is set to the cores this bench uses unless the caller set it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from pagedgen.bench.checkpoints import NO_CHECKPOINT, hf_dir_for_loaders
from pagedgen.bench.records import SystemRun, SystemSkipped
from pagedgen.bench.workloads import BenchRequest
from pagedgen.core.json_value import JsonObject

DRIVER = Path(__file__).with_name("vllm_driver.py")
THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def venv_python(venv: Path | None) -> Path:
    """``<venv>/bin/python``, or this interpreter when no venv is given."""
    return Path(sys.executable) if venv is None else Path(venv) / "bin" / "python"


def cpu_list(cores: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (the form ``VLLM_CPU_OMP_THREADS_BIND`` takes)."""
    if not cores:
        raise ValueError("no cores to bind")
    spans: list[list[int]] = []
    for core in sorted(set(cores)):
        if spans and core == spans[-1][1] + 1:
            spans[-1][1] = core
        else:
            spans.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def cores_in_use(threads: int) -> list[int]:
    """The first ``threads`` CPUs this process may run on."""
    return sorted(os.sched_getaffinity(0))[:threads]


def driver_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault(THREADS_BIND_ENV, cpu_list(cores_in_use(threads)))
    return env


class VllmDriver:
    """One driver process running one vLLM engine; ``close`` ends it (so does this process's exit)."""

    def __init__(self, python: Path, model: Path, max_num_seqs: int, eager: bool, env: dict[str, str]):
        self._stderr: IO[str] = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in close())
        self._process = subprocess.Popen(
            # -P: the script's folder (pagedgen/bench) must not shadow the standard library: its profile.py
            # would stand in for the stdlib module that cProfile (imported by torch._dynamo) needs.
            [str(python), "-P", str(DRIVER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=env,
        )
        self.info = self._ask({"model": str(model), "max_num_seqs": max_num_seqs, "enforce_eager": eager})

    def generate(self, requests: Sequence[BenchRequest]) -> JsonObject:
        return self._ask({"requests": [[list(r.prompt_ids), r.output_len] for r in requests]})

    def _ask(self, message: JsonObject) -> JsonObject:
        """Send one message, read one reply; raises SystemSkipped or RuntimeError as the driver reports."""
        assert self._process.stdin is not None and self._process.stdout is not None
        try:
            self._process.stdin.write(json.dumps(message) + "\n")
            self._process.stdin.flush()
        except BrokenPipeError:
            pass  # reported below, with the driver's stderr
        line = self._process.stdout.readline()
        if not line:
            tail = self.stderr_tail()
            self.close()
            raise RuntimeError(f"the vLLM driver exited ({self._process.returncode}): {tail}")
        reply = json.loads(line)
        if "skipped" in reply:
            self.close()
            raise SystemSkipped(reply["skipped"])
        if "error" in reply:
            raise RuntimeError(f"vLLM: {reply['error']}")
        return reply.get("ready", reply)

    def stderr_tail(self, chars: int = 2000) -> str:
        self._stderr.seek(0)
        return self._stderr.read()[-chars:]

    def close(self) -> None:
        if self._process.stdin is not None and not self._process.stdin.closed:
            self._process.stdin.close()
        try:
            self._process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._stderr.close()


class Vllm:
    """A baseline runner: one driver per batch size, started on the first run and reused after."""

    def __init__(self, checkpoint_dir: Path | None, venv: Path | None, *, enforce_eager: bool, threads: int):
        self.checkpoint_dir = checkpoint_dir
        self.python = venv_python(venv)
        self.enforce_eager = enforce_eager
        self.threads = threads
        self._driver: VllmDriver | None = None
        self._batch = 0
        self._staging: tempfile.TemporaryDirectory[str] | None = None

    def run(self, requests: Sequence[BenchRequest], max_batch_size: int) -> SystemRun:
        if self.checkpoint_dir is None:
            raise SystemSkipped(NO_CHECKPOINT)
        if not self.python.is_file():
            raise SystemSkipped(f"no Python interpreter at {self.python} (--vllm-venv names the venv's root)")
        driver = self._driver_for(max_batch_size)
        reply = driver.generate(requests)
        details = {"python": str(self.python), **driver.info}
        return SystemRun(reply["outputs"], reply["wall_s"], details=details)

    def _driver_for(self, max_batch_size: int) -> VllmDriver:
        if self._driver is None or self._batch != max_batch_size:
            self.close()
            assert self.checkpoint_dir is not None
            self._staging = tempfile.TemporaryDirectory(prefix="pagedgen-vllm-")
            model = hf_dir_for_loaders(self.checkpoint_dir, Path(self._staging.name) / "model")
            env = driver_env(self.threads)
            self._driver = VllmDriver(self.python, model, max_batch_size, self.enforce_eager, env)
            self._batch = max_batch_size
        return self._driver

    def close(self) -> None:
        if self._driver is not None:
            self._driver.close()
            self._driver = None
        if self._staging is not None:
            self._staging.cleanup()
            self._staging = None
