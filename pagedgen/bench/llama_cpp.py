"""The ``llama.cpp`` baseline: llama.cpp's own binaries on the very GGUF file pagedgen loaded.

Why llama.cpp's own binaries on the very file pagedgen loaded: it is the reference CPU engine for GGUF files,
and its server is the one peer measurement that runs pagedgen's workload itself (the same prompts as token
ids, each request's own length, a batch cap, tokens back for the match rate). docs/performance.md, "Module
notes: ops and bench", has the rest.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from pagedgen.bench.checkpoints import NO_CHECKPOINT
from pagedgen.bench.records import SystemRun, SystemSkipped
from pagedgen.bench.workloads import BenchRequest
from pagedgen.core.json_value import JsonObject

SERVER = "llama-server"
BENCH = "llama-bench"
BATCHED = "llama-batched-bench"
BATCHED_SHAPE = (100, 128, (1, 32))  # prompt, generated tokens, parallel sequences: B1's and W1's shapes
SLOT_ROUNDING = 256
START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 3600.0
MAX_CLIENT_THREADS = 256
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class LlamaCppTools:
    """The binaries of one llama.cpp build; each is None when the folder lacks it."""

    directory: Path
    server: Path | None
    bench: Path | None
    batched_bench: Path | None = None

    @classmethod
    def in_dir(cls, directory: Path | None, needed: str) -> LlamaCppTools:
        """The tools in ``directory``; raises :class:`SystemSkipped` when ``needed`` (a tool's file name)
        or the folder is missing."""
        if directory is None:
            raise SystemSkipped("no --llama-cpp-dir given (a folder holding llama-server and llama-bench)")
        found = [p if p.is_file() else None for p in (Path(directory) / n for n in (SERVER, BENCH, BATCHED))]
        tools = cls(Path(directory), *found)
        if not (Path(directory) / needed).is_file():
            raise SystemSkipped(f"--llama-cpp-dir {directory} has no {needed}")
        return tools


def gguf_source(checkpoint_dir: Path | None) -> Path:
    """The GGUF file a pagedgen cache entry was made from; raises :class:`SystemSkipped` otherwise."""
    if checkpoint_dir is None:
        raise SystemSkipped("the model has no checkpoint directory: llama.cpp needs its GGUF file")
    try:
        config = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise SystemSkipped(f"{checkpoint_dir}: no readable config.json ({exc})") from exc
    source = (config.get("pagedgen_source") or {}).get("gguf")
    if not source:
        raise SystemSkipped(f"{checkpoint_dir} was not made from a GGUF file: llama.cpp runs GGUF files only")
    path = Path(source)
    if not path.is_file():
        raise SystemSkipped(f"the model's GGUF file {path} no longer exists")
    return path


def slot_context(requests: Sequence[BenchRequest]) -> int:
    """Tokens of context per server slot: the longest request (prompt + output) rounded up to 256."""
    longest = max(len(r.prompt_ids) + r.output_len for r in requests)
    return -(-(longest + 1) // SLOT_ROUNDING) * SLOT_ROUNDING


def server_command(
    server: Path, gguf: Path, *, threads: int, slots: int, slot_ctx: int, port: int
) -> list[str]:
    """``llama-server`` on loopback: ``slots`` parallel sequences of ``slot_ctx`` tokens each."""
    return [
        str(server),
        "-m", str(gguf),
        "-t", str(threads),
        "-tb", str(threads),
        "-np", str(slots),
        "-c", str(slots * slot_ctx),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--no-webui",
        "--cache-ram", "0",  # no host-memory prompt cache: the warm-up's prompts must not be reused
    ]  # fmt: skip


def completion_body(request: BenchRequest) -> JsonObject:
    """The ``/completion`` request of one bench request: its token ids, greedy, exactly its length."""
    return {
        "prompt": list(request.prompt_ids),
        "n_predict": request.output_len,
        "temperature": 0.0,
        "top_k": 1,
        "ignore_eos": True,
        "cache_prompt": False,
        "return_tokens": True,
        "stream": False,
    }


def completion_tokens(reply: JsonObject, request: BenchRequest) -> list[int]:
    """The generated ids of a ``/completion`` reply; raises ValueError when they are missing or short."""
    tokens = reply.get("tokens")
    if not isinstance(tokens, list):
        raise ValueError(f"llama-server's reply to request {request.index} has no 'tokens' list")
    if len(tokens) != request.output_len:
        stop = reply.get("stop_type", "?")
        raise ValueError(
            f"llama-server generated {len(tokens)} tokens for request {request.index}, "
            f"asked for {request.output_len} (stop_type {stop})"
        )
    return [int(t) for t in tokens]


def reply_timings(replies: Sequence[JsonObject]) -> dict[str, float]:
    """The server's own prompt / generation milliseconds and token counts, summed over the replies."""
    keys = ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms")
    return {k: float(sum(r.get("timings", {}).get(k, 0) for r in replies)) for k in keys}


def bench_command(bench: Path, gguf: Path, *, threads: int, repetitions: int = 3) -> list[str]:
    """``llama-bench`` for pp512 and tg128 on ``threads`` threads, JSON on stdout."""
    return [
        str(bench), "-m", str(gguf), "-t", str(threads),
        "-p", "512", "-n", "128", "-r", str(repetitions), "-o", "json",
    ]  # fmt: skip


@dataclass(frozen=True, slots=True)
class BenchFigure:
    """One llama-bench test: ``pp512`` (prompt tokens/s) or ``tg128`` (generated tokens/s)."""

    test: str
    tokens_per_s: float
    stddev: float
    repetitions: int

    def to_dict(self) -> JsonObject:
        return {"tokens_per_s": self.tokens_per_s, "stddev": self.stddev, "repetitions": self.repetitions}


def parse_llama_bench(text: str) -> dict[str, BenchFigure]:
    """``llama-bench -o json``'s array -> ``{"pp512": ..., "tg128": ...}``; ValueError on other text."""
    try:
        entries = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"llama-bench printed no JSON array: {text[:200]!r}") from exc
    if not isinstance(entries, list) or not entries:
        raise ValueError("llama-bench's JSON holds no tests")
    figures = {}
    for entry in entries:
        n_prompt, n_gen = int(entry["n_prompt"]), int(entry["n_gen"])
        test = f"pp{n_prompt}" if n_gen == 0 else f"tg{n_gen}" if n_prompt == 0 else f"pp{n_prompt}+tg{n_gen}"
        samples = entry.get("samples_ts") or []
        figures[test] = BenchFigure(test, float(entry["avg_ts"]), float(entry["stddev_ts"]), len(samples))
    return figures


def bench_info(text: str) -> JsonObject:
    """What llama-bench says about the build and machine (first test's fields), for the JSON record."""
    entry = json.loads(text)[0]
    keys = ("build_commit", "build_number", "cpu_info", "backends", "model_type", "model_size", "n_threads")
    return {k: entry[k] for k in keys if k in entry}


def batched_bench_command(batched_bench: Path, gguf: Path, *, threads: int) -> list[str]:
    """``llama-batched-bench`` at :data:`BATCHED_SHAPE`, one JSON line per parallel count on stdout."""
    prompt, gen, parallel = BATCHED_SHAPE
    context = -(-max(parallel) * (prompt + gen) // SLOT_ROUNDING) * SLOT_ROUNDING
    return [
        str(batched_bench), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-c", str(context),
        "-npp", str(prompt), "-ntg", str(gen), "-npl", ",".join(map(str, parallel)),
        "--output-format", "jsonl",
    ]  # fmt: skip


def parse_batched_bench(text: str) -> dict[str, dict[str, float]]:
    """``llama-batched-bench --output-format jsonl`` -> ``{"pl1": {...}, "pl32": {...}}``: each line's times
    and speeds, plus ``out_tokens_per_s`` (generated tokens over the whole time, prefill included, as a
    workload's output throughput counts them). Raises ValueError when no line is JSON."""
    found = {}
    for line in text.splitlines():
        if not line.startswith("{"):
            continue  # its log lines
        entry = json.loads(line)
        keys = ("pp", "tg", "pl", "t_pp", "speed_pp", "t_tg", "speed_tg", "t", "speed")
        row = {k: float(entry[k]) for k in keys}
        row["out_tokens_per_s"] = row["pl"] * row["tg"] / row["t"]
        found[f"pl{int(row['pl'])}"] = row
    if not found:
        raise ValueError(f"llama-batched-bench printed no JSON lines: {text[:200]!r}")
    return found


def _run_tool(command: list[str]) -> str:
    """A tool's stdout; RuntimeError with its output's tail when it fails."""
    done = subprocess.run(command, capture_output=True, text=True, check=False, preexec_fn=_die_with_parent)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout)[-2000:]
        raise RuntimeError(f"{Path(command[0]).name} failed ({done.returncode}): {tail}")
    return done.stdout


def llama_bench(
    directory: Path | None, checkpoint_dir: Path | None, threads: int, repetitions: int = 3
) -> JsonObject:
    """Run llama-bench once (and llama-batched-bench, when present): ``{"figures": {test: {...}}, "info":
    {...}, "command": [...], "batched": {...} or absent}``.

    Raises :class:`SystemSkipped` (no tools, no GGUF file) or RuntimeError with the failing tool's output.
    """
    tools = LlamaCppTools.in_dir(directory, BENCH)
    gguf = gguf_source(checkpoint_dir)
    assert tools.bench is not None
    command = bench_command(tools.bench, gguf, threads=threads, repetitions=repetitions)
    text = _run_tool(command)
    found: JsonObject = {
        "figures": {k: f.to_dict() for k, f in parse_llama_bench(text).items()},
        "info": bench_info(text),
        "command": command,
    }
    if tools.batched_bench is not None:  # a cross-check: its failure is recorded, llama-bench's figures kept
        batched = batched_bench_command(tools.batched_bench, gguf, threads=threads)
        try:
            found["batched"] = {"figures": parse_batched_bench(_run_tool(batched)), "command": batched}
        except (RuntimeError, ValueError) as exc:
            found["batched"] = {"status": "failed", "reason": str(exc), "command": batched}
    return found


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM it when the bench process dies (no orphaned server)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """One ``llama-server`` process; ``close`` ends it (so do this process's exit and death)."""

    def __init__(self, command: list[str], port: int):
        self.command = command
        self.url = f"http://127.0.0.1:{port}"
        self._log: IO[str] = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in close())
        self._process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
        )
        atexit.register(self.close)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                tail = self.log_tail()
                self.close()
                raise RuntimeError(f"llama-server exited ({self._process.returncode}): {tail}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # still loading (503) or not listening yet
            time.sleep(0.2)
        self.close()
        raise RuntimeError(f"llama-server did not become ready within {START_TIMEOUT_S:.0f} s")

    def complete(self, body: JsonObject) -> JsonObject:
        data = json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + "/completion", data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"llama-server answered {exc.code}: {exc.read()[:500]!r}") from exc

    def peak_rss_bytes(self) -> int | None:
        """The server process's resident high-water mark (``VmHWM``), None once it has exited."""
        try:
            for line in Path(f"/proc/{self._process.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except (OSError, ValueError):
            return None
        return None

    def log_tail(self, chars: int = 2000) -> str:
        if self._log.closed:
            return ""
        self._log.seek(0)
        return self._log.read()[-chars:]

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        if not self._log.closed:
            self._log.close()
        atexit.unregister(self.close)


class LlamaCpp:
    """The baseline runner: one server per (batch size, slot context), started on first use, reused after."""

    def __init__(self, directory: Path | None, checkpoint_dir: Path | None, *, threads: int):
        self.directory = directory
        self.checkpoint_dir = checkpoint_dir
        self.threads = threads
        self._server: LlamaServer | None = None
        self._shape: tuple[int, int] | None = None

    def run(self, requests: Sequence[BenchRequest], max_batch_size: int) -> SystemRun:
        if self.checkpoint_dir is None:
            raise SystemSkipped(NO_CHECKPOINT)
        tools = LlamaCppTools.in_dir(self.directory, SERVER)
        gguf = gguf_source(self.checkpoint_dir)
        assert tools.server is not None
        server = self._server_for(tools.server, gguf, max_batch_size, slot_context(requests))
        workers = min(len(requests), MAX_CLIENT_THREADS)
        with ThreadPoolExecutor(max_workers=workers) as pool:
            start = time.perf_counter()
            replies = list(pool.map(server.complete, [completion_body(r) for r in requests]))
            wall = time.perf_counter() - start
        outputs = [completion_tokens(reply, r) for reply, r in zip(replies, requests, strict=True)]
        details: JsonObject = {"gguf": str(gguf), "slots": max_batch_size, "threads": self.threads}
        details["server_timings"] = reply_timings(replies)
        details["server_peak_rss_bytes"] = server.peak_rss_bytes()
        details["command"] = server.command
        return SystemRun(outputs, wall, details=details)

    def _server_for(self, binary: Path, gguf: Path, slots: int, slot_ctx: int) -> LlamaServer:
        """The running server when it has ``slots`` slots of at least ``slot_ctx`` tokens, else a new one,
        warmed up by one short untimed completion (first-call allocations stay out of every timed run)."""
        shape = self._shape
        if self._server is None or shape is None or shape[0] != slots or shape[1] < slot_ctx:
            self.close()
            port = free_port()
            command = server_command(
                binary, gguf, threads=self.threads, slots=slots, slot_ctx=slot_ctx, port=port
            )
            self._server = LlamaServer(command, port)
            self._shape = (slots, slot_ctx)
            self._server.complete(completion_body(BenchRequest(-1, (1, 2, 3, 4), 2)))
        return self._server

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
            self._shape = None
