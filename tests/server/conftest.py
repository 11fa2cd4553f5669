"""Shared fixtures of the server tests: one live server per session, on the default model (tests/conftest.py).

The server runs in this process (uvicorn on a background thread, 127.0.0.1, a free port) so the tests can
compare its output with the engine's own greedy output on the same loaded model, through ``pg.LLM``.
"""

from __future__ import annotations

import openai
import pytest

import pagedgen as pg
from pagedgen.server.app import ServerOptions, build_app
from tests.server.live import API_KEY, MAX_BODY_BYTES, MODEL_NAME, LiveServer


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
