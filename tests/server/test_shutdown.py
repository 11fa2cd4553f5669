"""Graceful shutdown (``pagedgen serve --shutdown-timeout``), with real signals on a server subprocess.

Each test starts ``pagedgen serve`` on the default model (loopback, a free port), puts requests in flight,
signals the process and reads every response to its end: requests that finish within the timeout complete
normally, the rest end with the error event and ``data: [DONE]`` (streams) or the JSON error body; requests
that arrive during the drain get 503 with ``Retry-After``; the process exits with 0, logs no traceback, and
reports every KV block free. Every wait is bounded: a test that hangs fails.

The in-process tests drive the same drain on the synthetic model (``should_exit`` stands in for the signal,
which only the main thread may take), where a model held at a gate makes "still in flight" exact.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from pagedgen.server.worker import EngineWorker
from tests.server.doubles import NUM_BLOCKS, VOCAB, GatedModel, expected_text
from tests.server.serving import serve_synthetic

ROOT = Path(__file__).resolve().parents[2]  # this checkout: the subprocess serves its code
WAIT_S = 300  # the bound of every wait: model load on a loaded 2-core machine, a drain, an exit
LONG = 2000  # tokens no drain of a few seconds lets finish on a CPU
SHORT = 3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServeProcess:
    """``pagedgen serve`` as a subprocess; stderr goes to a file (read after the exit)."""

    def __init__(self, tmp_path: Path, *flags: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.stderr_path = tmp_path / "serve.stderr"
        command = [sys.executable, "-m", "pagedgen.cli", "serve", "--port", str(self.port)]
        command += ["--max-batch-size", "4", "--num-blocks", "320", *flags]
        self._stderr = self.stderr_path.open("wb")
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        env.pop("PAGEDGEN_API_KEY", None)
        self.proc = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=self._stderr, env=env, cwd=ROOT
        )
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the server exited: {self.stderr()}"
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError("the server never became healthy")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=WAIT_S)
        finally:
            self._stderr.close()

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=WAIT_S)
        self._stderr.close()


@pytest.fixture
def spawn(tmp_path):
    started: list[ServeProcess] = []

    def start(*flags: str) -> ServeProcess:
        started.append(ServeProcess(tmp_path, *flags))
        return started[-1]

    yield start
    for proc in started:
        proc.kill()


def _body(
    max_tokens: int, stream: bool, model: str = "default", prompt: str | list[int] = "Once upon a time"
):
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


class StreamReader(threading.Thread):
    """Reads one completion stream to its end; ``first`` is set once a token chunk has arrived."""

    def __init__(self, url: str, max_tokens: int, **body):
        super().__init__(daemon=True)
        self.url, self.body = url, _body(max_tokens, True, **body)
        self.first = threading.Event()
        self.events: list[str] = []
        self.status = 0

    def run(self) -> None:
        with httpx.stream("POST", self.url + "/v1/completions", json=self.body, timeout=WAIT_S) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line.removeprefix("data: "))
                    self.first.set()
        self.first.set()

    def payloads(self) -> list[dict]:
        assert self.events[-1] == "[DONE]", self.events[-3:]
        return [json.loads(e) for e in self.events[:-1]]

    def text(self) -> str:
        return "".join(p["choices"][0]["text"] for p in self.payloads() if "choices" in p)


class PlainRequest(threading.Thread):
    def __init__(self, url: str, max_tokens: int, **body):
        super().__init__(daemon=True)
        self.url, self.body = url, _body(max_tokens, False, **body)
        self.response: httpx.Response | None = None

    def run(self) -> None:
        self.response = httpx.post(self.url + "/v1/completions", json=self.body, timeout=WAIT_S)


def _admitted(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    match = re.search(r"^pagedgen:num_requests_admitted\{[^}]*\} (\S+)$", text, re.MULTILINE)
    assert match is not None
    return float(match.group(1))


def _wait(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


def _wait_draining(url: str) -> httpx.Response:
    """``/health`` once it reports the drain (the signal was handled)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        response = httpx.get(url + "/health", timeout=30)
        if response.status_code == 503:
            return response
        time.sleep(0.05)
    raise AssertionError("the server never reported its drain")


def _assert_shutdown_error(error: dict) -> None:
    assert error["code"] == "shutting_down"
    assert error["type"] == "service_unavailable"
    assert error["message"] == "the server is shutting down"


def _assert_clean_exit(server: ServeProcess) -> None:
    assert server.wait() == 0
    log = server.stderr()
    assert "Traceback" not in log and "CancelledError" not in log, log
    blocks = re.findall(r"engine stopping: (\d+) of (\d+) KV-cache blocks free", log)
    assert len(blocks) == 1 and blocks[0][0] == blocks[0][1] == "320", log


@pytest.mark.model
def test_sigterm_finishes_what_fits_the_timeout_ends_the_rest_and_exits_0(spawn):
    server = spawn("--shutdown-timeout", "10")
    long_stream = StreamReader(server.url, LONG)
    long_plain = PlainRequest(server.url, LONG)
    long_stream.start()
    long_plain.start()
    assert long_stream.first.wait(WAIT_S)
    _wait(lambda: _admitted(server.url) == 2, "both long requests admitted")
    short_stream = StreamReader(server.url, SHORT)
    short_plain = PlainRequest(server.url, SHORT)
    short_stream.start()
    short_plain.start()

    def admitted_or_done() -> bool:  # short ones may finish first: the in-process tests pin that case exactly
        return _admitted(server.url) == 4 or not (short_stream.is_alive() or short_plain.is_alive())

    _wait(admitted_or_done, "all four requests admitted")

    server.signal(signal.SIGTERM)
    health = _wait_draining(server.url)
    _assert_shutdown_error(health.json()["error"])
    refused = httpx.post(server.url + "/v1/completions", json=_body(SHORT, False), timeout=30)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.headers["content-type"] == "application/json"
    _assert_shutdown_error(refused.json()["error"])

    for thread in (long_stream, long_plain, short_stream, short_plain):
        thread.join(WAIT_S)
        assert not thread.is_alive()
    short = short_stream.payloads()  # finished normally: text chunks, the finish reason, then [DONE]
    assert short[-1]["choices"][0]["finish_reason"] == "length" and "error" not in short[-1]
    assert short_plain.response.status_code == 200
    assert short_plain.response.json()["usage"]["completion_tokens"] == SHORT
    cut = long_stream.payloads()  # tokens, then the error event, then [DONE]
    assert long_stream.status == 200 and "choices" in cut[0]
    _assert_shutdown_error(cut[-1]["error"])
    assert all("error" not in p for p in cut[:-1])
    assert long_plain.response.status_code == 503
    assert long_plain.response.headers["content-type"] == "application/json"
    _assert_shutdown_error(long_plain.response.json()["error"])
    _assert_clean_exit(server)


@pytest.mark.model
def test_sigint_drains_and_a_second_signal_ends_the_wait(spawn):
    """Ctrl-C: the drain would wait 600 s; the second Ctrl-C ends it at once (the test's bound is 300 s)."""
    server = spawn("--shutdown-timeout", "600")
    stream = StreamReader(server.url, LONG)
    plain = PlainRequest(server.url, LONG)
    stream.start()
    plain.start()
    assert stream.first.wait(WAIT_S)
    _wait(lambda: _admitted(server.url) == 2, "both requests admitted")
    server.signal(signal.SIGINT)
    _wait_draining(server.url)
    assert stream.is_alive() and plain.is_alive()  # the drain waits for them
    server.signal(signal.SIGINT)
    for thread in (stream, plain):
        thread.join(WAIT_S)
        assert not thread.is_alive()
    _assert_shutdown_error(stream.payloads()[-1]["error"])
    assert plain.response.status_code == 503
    _assert_shutdown_error(plain.response.json()["error"])
    _assert_clean_exit(server)


# ---------------------------------------------------------------- in process, synthetic model


@pytest.fixture
def abort_called(monkeypatch):
    """Set when the drain's timeout has run out and it asks the engine thread to end what is left."""
    called = threading.Event()
    original = EngineWorker.abort

    def abort(self):
        original(self)
        called.set()

    monkeypatch.setattr(EngineWorker, "abort", abort)
    return called


SYNTHETIC = {"model": "synthetic", "prompt": [5, 6, 7]}


def test_the_drain_ends_a_request_that_outlives_the_timeout_and_frees_its_blocks(abort_called):
    model = GatedModel(vocab_size=VOCAB)
    served = serve_synthetic(model, shutdown_timeout=0.5)
    try:
        stream = StreamReader(served.url, 5, **SYNTHETIC)
        stream.start()
        assert model.entered.wait(WAIT_S)  # its first step is held at the gate: it cannot finish
        served.request_exit()
        _wait(lambda: served.app.state.admission.closed, "the drain began")
        refused = httpx.post(served.url + "/v1/chat/completions", json={"model": "synthetic", "messages": []})
        assert refused.status_code == 503 and refused.headers["connection"] == "close"
        _assert_shutdown_error(refused.json()["error"])
        assert abort_called.wait(WAIT_S)
        model.gate.set()  # the held step ends; the abort queued behind it ends the request
        stream.join(WAIT_S)
        assert not stream.is_alive()
        _assert_shutdown_error(stream.payloads()[-1]["error"])
        served.join()
    finally:
        model.gate.set()
        served.stop()
    snapshot = served.app.state.worker.snapshot
    assert snapshot.free_blocks == snapshot.total_blocks == NUM_BLOCKS and snapshot.jobs == 0


def test_requests_admitted_before_the_signal_complete_exactly(abort_called):
    model = GatedModel(vocab_size=VOCAB)
    served = serve_synthetic(model, shutdown_timeout=WAIT_S)
    try:
        streams = [StreamReader(served.url, 6, **SYNTHETIC) for _ in range(3)]
        plain = PlainRequest(served.url, 6, **SYNTHETIC)
        for thread in (*streams, plain):
            thread.start()
        _wait(lambda: served.app.state.admission.in_flight == 4, "all four admitted")
        served.request_exit()
        _wait(lambda: served.app.state.admission.closed, "the drain began")
        model.gate.set()
        for thread in (*streams, plain):
            thread.join(WAIT_S)
        served.join()  # the drain ended when the last response did: nothing was aborted
    finally:
        model.gate.set()
        served.stop()
    expected = expected_text(SYNTHETIC["prompt"], 6)
    assert [s.text() for s in streams] == [expected] * 3
    assert plain.response.status_code == 200 and plain.response.json()["choices"][0]["text"] == expected
    assert not abort_called.is_set()
    snapshot = served.app.state.worker.snapshot
    assert snapshot.free_blocks == snapshot.total_blocks == NUM_BLOCKS
