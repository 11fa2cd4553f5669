"""A server built as ``pagedgen serve`` builds it (:func:`pagedgen.server.lifecycle.build_server`), run on a
background thread of this process, bound to 127.0.0.1 on a free port.

A signal can only be taken by the main thread; ``request_exit()`` calls the server's own signal handler, as
SIGTERM would (the subprocess tests in ``test_shutdown.py`` send real signals).
"""

from __future__ import annotations

import signal
import socket
import threading

import pagedgen as pg
from pagedgen.models.synthetic import SyntheticTokenizer
from pagedgen.server.app import ServerOptions, build_app
from pagedgen.server.lifecycle import PagedgenServer, build_server
from tests.server.doubles import NUM_BLOCKS, VOCAB

JOIN_S = 300


class ServedApp:
    def __init__(self, app) -> None:
        self.app = app
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server: PagedgenServer = build_server(app, host="127.0.0.1", port=self.port, log_level="warning")
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)
        self._started = threading.Event()

    def start(self) -> ServedApp:
        original = self.server.startup

        async def startup(sockets=None):
            try:
                await original(sockets=sockets)
            finally:
                self._started.set()

        self.server.startup = startup
        self._thread.start()
        assert self._started.wait(JOIN_S) and self.server.started, "the server did not start"
        return self

    def request_exit(self) -> None:
        """What SIGTERM does: the first call starts the drain, a second one ends its wait."""
        self.server.handle_exit(signal.SIGTERM, None)

    def join(self) -> None:
        self._thread.join(JOIN_S)
        assert not self._thread.is_alive(), "the server did not stop"
        self._sock.close()

    def stop(self) -> None:
        if self._thread.is_alive():
            self.request_exit()
            self.request_exit()
        self.join()


def serve_synthetic(model, *, max_batch_size: int = 8, **options) -> ServedApp:
    """A served synthetic model (the synthetic codec), with ``ServerOptions(**options)``."""
    config = pg.EngineConfig(max_batch_size=max_batch_size, num_blocks=NUM_BLOCKS, debug_invariants=True)
    app = build_app(
        model, config, ServerOptions(model_name="synthetic", **options), tokenizer=SyntheticTokenizer(VOCAB)
    )
    return ServedApp(app).start()
