"""Shared fixtures of the server tests: one default-model load and one live server per session.

The server runs in this process (uvicorn on a background thread, 127.0.0.1, a free port) so the tests can
compare its output with the engine's own greedy output on the same loaded model, through ``pg.LLM``.
"""

from __future__ import annotations

import re

import openai
import pytest

import pagedgen as pg
from pagedgen.server.app import ServerOptions, build_app
from tests.server.live import LiveServer

API_KEY = "test-key-123"
MAX_BODY_BYTES = 256 * 1024
MODEL_NAME = "default"


@pytest.fixture(scope="session")
def default_model():
    return pg.Model("default")


@pytest.fixture(scope="session")
def reference_llm(default_model):
    """The engine run directly (no server) on the same model: the oracle for the server's text."""
    return pg.LLM(default_model, pg.EngineConfig(max_batch_size=32, num_blocks=256))


@pytest.fixture(scope="session")
def live_server(default_model):
    config = pg.EngineConfig(max_batch_size=32, num_blocks=384, debug_invariants=True)
    options = ServerOptions(model_name=MODEL_NAME, api_key=API_KEY, max_body_bytes=MAX_BODY_BYTES)
    server = LiveServer(build_app(default_model, config, options)).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def client(live_server):
    return openai.OpenAI(base_url=live_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=900)


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
