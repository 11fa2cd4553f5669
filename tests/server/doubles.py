"""Synthetic-model servers for the server tests: exact tokens, a model that fails, a model held at a gate.

The synthetic model's greedy continuation is a closed formula (``synthetic_greedy``), so every completion's
text is known exactly. ``settled_metrics`` reads ``/metrics`` after the worker has applied every command
queued so far (``/metrics`` itself never waits for the engine thread, so a test that needs a cancel to be
applied first must wait for it here).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
import openai

import pagedgen as pg
from pagedgen.models.synthetic import SyntheticModel, SyntheticTokenizer, synthetic_greedy
from pagedgen.server.app import ServerOptions, build_app
from tests.server.live import LiveServer

VOCAB = 95
NUM_BLOCKS = 64
POISON = 13  # a prompt holding this token makes the failing model's forward raise


class ModelFailure(Exception):
    """Not an error type the engine knows: an unknown execution failure, which is fatal."""


class FailingModel(SyntheticModel):
    def forward(self, inputs, kv_cache):
        if bool((inputs.input_ids == POISON).any()):
            raise ModelFailure("the accelerator caught fire")
        return super().forward(inputs, kv_cache)


class GatedModel(SyntheticModel):
    """Every forward waits at ``gate``; ``entered`` is set when the first one starts (the test drives it)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.entered = threading.Event()
        self.gate = threading.Event()

    def forward(self, inputs, kv_cache):
        self.entered.set()
        self.gate.wait()
        return super().forward(inputs, kv_cache)


def serve(model, *, max_batch_size: int = 8, tokenizer=None, **options) -> LiveServer:
    """A live server of ``model`` (the synthetic codec unless ``tokenizer`` is given)."""
    config = pg.EngineConfig(max_batch_size=max_batch_size, num_blocks=NUM_BLOCKS, debug_invariants=True)
    server_options = ServerOptions(model_name="synthetic", **options)
    tokenizer = tokenizer if tokenizer is not None else SyntheticTokenizer(VOCAB)
    app = build_app(model, config, server_options, tokenizer=tokenizer)
    return LiveServer(app).start()


def client_of(server: LiveServer, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=120)


def expected_text(prompt: list[int], max_tokens: int) -> str:
    return SyntheticTokenizer(VOCAB).decode(synthetic_greedy(prompt, max_tokens, VOCAB))


def app_state(server: LiveServer):
    return server.server.config.app.state


def settled_metrics(server: LiveServer) -> str:
    """``/metrics`` once the worker has applied every command queued before this call."""
    done = threading.Event()
    app_state(server).worker.sync(lambda _snapshot: done.set())
    assert done.wait(timeout=120), "the worker never applied the queued commands"
    return httpx.get(server.url + "/metrics").text


def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Wait for something the server does on its own schedule (a disconnect noticed, a request admitted)."""
    deadline = time.monotonic() + 120
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


class ChatTokenizer(SyntheticTokenizer):
    """The synthetic codec with a chat template: ``role: content`` lines; remembers the tools it saw."""

    def __init__(self, vocab_size: int):
        super().__init__(vocab_size)
        self.seen_tools: list[object] = []

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None, **_variables) -> str:
        self.seen_tools.append(tools)
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        return "\n".join(lines) + ("\nassistant: " if add_generation_prompt else "")


def serve_counting_submits(model, tokenizer) -> LiveServer:
    """:func:`serve` whose ``.submitted`` lists every job handed to the worker (refusals submit none)."""
    live = serve(model, tokenizer=tokenizer)
    worker = app_state(live).worker
    submitted = []
    original = worker.submit

    def counting_submit(*args, **kwargs):
        submitted.append(args)
        return original(*args, **kwargs)

    worker.submit = counting_submit
    live.submitted = submitted
    live.tokenizer = tokenizer
    return live
