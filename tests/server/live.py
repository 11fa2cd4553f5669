"""A uvicorn server running an app on a background thread, bound to 127.0.0.1 on a free port; the settings
the shared live server runs with, and reading one sample of its ``/metrics``."""

from __future__ import annotations

import re
import socket
import threading

import uvicorn

API_KEY = "test-key-123"
MAX_BODY_BYTES = 256 * 1024
MODEL_NAME = "default"


class LiveServer:
    """Start with ``start()`` (returns once uvicorn accepts connections), stop with ``stop()``."""

    def __init__(self, app):
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="uvicorn", daemon=True)
        self._started = threading.Event()
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self._sock])
        except BaseException as exc:  # surfaced by start()
            self._error = exc
        finally:
            self._started.set()

    def start(self) -> LiveServer:
        original = self.server.startup

        async def startup(sockets=None):
            await original(sockets=sockets)
            self._started.set()

        self.server.startup = startup
        self._thread.start()
        self._started.wait()
        if self._error is not None or not self.server.started:
            raise RuntimeError(f"the server did not start: {self._error!r}")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join()
        self._sock.close()


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of a Prometheus text exposition (labels must match exactly)."""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        match = re.fullmatch(r"([^{\s]+)(?:\{(.*)\})?\s+(\S+)", line)
        if match is None or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(3))
    raise KeyError(f"no sample {name}{labels} in the metrics")
