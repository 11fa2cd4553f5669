"""Start and stop ``pagedgen serve`` subprocesses for a bench that compares server settings in one run.

``pagedgen bench serve --launch MODEL --mixed-step-tokens 2048 default`` needs one server per setting. Each
is its own process (as in a deployment: the bench's client never shares a GIL with the engine), bound to
127.0.0.1 on a free port, ready once ``GET /health`` answers 200. Stopping sends SIGTERM and, if the server
has not exited within ``STOP_TIMEOUT_S``, SIGKILL.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pagedgen.bench.extras import require

HOST = "127.0.0.1"
STOP_TIMEOUT_S = 60.0


@dataclass(slots=True)
class LaunchedServer:
    """A ``pagedgen serve`` subprocess and the base URL it answers on."""

    label: str
    url: str
    process: subprocess.Popen

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def serve_command(
    model: str, port: int, mixed_step_tokens: int | None, extra: Sequence[str] = ()
) -> list[str]:
    """The ``pagedgen serve`` command line of one launched server (``None``: the server's default budget)."""
    command = [sys.executable, "-m", "pagedgen.cli", "serve", "--model", model]
    command += ["--host", HOST, "--port", str(port), "--log-level", "warning"]
    if mixed_step_tokens is not None:
        command += ["--max-mixed-step-tokens", str(mixed_step_tokens)]
    return command + list(extra)


def launch(label: str, command: Sequence[str], port: int, timeout_s: float = 600.0) -> LaunchedServer:
    """Start ``command`` and wait until its ``/health`` answers 200. Raises RuntimeError (after stopping it)
    if the process exits first or ``timeout_s`` passes."""
    httpx = require("httpx", "pagedgen bench serve --launch")
    server = LaunchedServer(label, f"http://{HOST}:{port}", subprocess.Popen(list(command)))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"{label}: the server exited with status {server.process.returncode}")
        try:
            if httpx.get(server.url + "/health", timeout=5.0).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"{label}: the server did not answer /health within {timeout_s:g} s")
