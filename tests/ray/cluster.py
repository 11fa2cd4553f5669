"""A local Ray cluster with the replicated synthetic application, for the tests of one module.

``ray.init(num_cpus=2)`` on loopback, Serve's proxy on a free 127.0.0.1 port, two replicas of one CPU each
on the synthetic model (so outputs are known exactly). Start-up takes most of a minute on a 2-core machine,
so a module shares one (its fixture) and tests measure what they need as deltas of the counters.
"""

from __future__ import annotations

import re
import socket
import subprocess
import time
from pathlib import Path

import httpx
import ray
from ray import serve

import pagedgen as pg
from pagedgen.server.app import ServerOptions
from pagedgen.server.replicas.application import APP_NAME, build_application
from pagedgen.server.replicas.client import POLL_S
from pagedgen.server.replicas.launch import start_local_ray
from pagedgen.server.replicas.setup import SYNTHETIC, ModelSource, ReplicaSetup

VOCAB = 95
NUM_BLOCKS = 256
MAX_BATCH = 8
POLLS = 240  # bounded waits for the ingress's next stats poll (each POLL_S / 2 apart)
# The single server's 503 body once the application drains (what every shutdown test expects).
SHUTDOWN_ERROR = {
    "message": "the server is shutting down",
    "type": "service_unavailable",
    "param": None,
    "code": "shutting_down",
}


def engine_config() -> pg.EngineConfig:
    return pg.EngineConfig(max_batch_size=MAX_BATCH, num_blocks=NUM_BLOCKS, debug_invariants=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, log_path: Path, wait_s: float, what: str) -> None:
    """Polls ``url``'s ``/health`` until it answers 200, for at most ``wait_s`` seconds; fails with the
    tail of ``log_path`` if the served process ``proc`` exits meanwhile, and saying ``what`` never became
    healthy if the time runs out."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{what} never became healthy")


class Cluster:
    """The running application: ``url`` is Serve's proxy."""

    def __init__(self, routing: str = "affinity") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        start_local_ray(num_cpus=2, log_to_driver=False, configure_logging=False)
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        setup = ReplicaSetup(
            source=ModelSource(SYNTHETIC, vocab_size=VOCAB),
            engine=engine_config(),
            options=ServerOptions(model_name="synthetic", shutdown_timeout=5),
            num_replicas=2,
            routing=routing,
        )
        serve.run(build_application(setup), name=APP_NAME, route_prefix="/")

    def close(self) -> None:
        serve.shutdown()
        ray.shutdown()


def metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=60).text


def per_replica(text: str, name: str) -> dict[str, float]:
    """One family's samples by ``replica`` label."""
    values = {}
    for match in re.finditer(rf"^{re.escape(name)}{{([^}}]*)}} (\S+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if "replica" in labels:
            values[labels["replica"]] = float(match.group(2))
    return values


def routed(text: str) -> dict[str, float]:
    """``pagedgen:routed_requests_total`` by ``route`` (how the router chose each generation's replica)."""
    pattern = r'^pagedgen:routed_requests_total\{model_name="[^"]*",route="(\w+)"\} (\S+)$'
    return {route: float(value) for route, value in re.findall(pattern, text, re.M)}


def wait_for_metrics(url: str, ready) -> str:
    """The first ``/metrics`` text that ``ready(text)`` accepts, polled at most :data:`POLLS` times (the
    ingress refreshes replica counters every ``POLL_S``); the last text if none did."""
    text = metrics(url)
    for _ in range(POLLS):
        if ready(text):
            return text
        time.sleep(POLL_S / 2)
        text = metrics(url)
    return text


def settled_metrics(url: str) -> str:
    """``/metrics`` once the replicas' counters stand still: two polls apart, the same prompt-token counts and
    nothing running (what earlier requests did has been counted)."""
    previous = metrics(url)
    for _ in range(POLLS):
        time.sleep(POLL_S * 1.5)
        text = metrics(url)
        counts = per_replica(text, "pagedgen:prompt_tokens_total")
        running = per_replica(text, "pagedgen:num_requests_running")
        if counts == per_replica(previous, "pagedgen:prompt_tokens_total") and not any(running.values()):
            return text
        previous = text
    return previous
