"""Synthetic-model servers for the server tests: exact tokens, a model that fails, a model held at a gate.

The synthetic model's greedy continuation is a closed formula (``synthetic_greedy``), so every completion's
text is known exactly. ``settled_metrics`` reads ``/metrics`` after the worker has applied every command
queued so far (``/metrics`` itself never waits for the engine thread, so a test that needs a cancel to be
applied first must wait for it here).
"""

from __future__ import annotations

import json
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


class TableTemplate(SyntheticTokenizer):
    """The synthetic codec with a chat template: ``/no_think`` first when ``enable_thinking`` is false, a
    ``tools: [names]`` line when tools are given, a ``role: content|`` line per message, ``assistant: ``."""

    def __init__(self, eos_token_id: int | None = None):
        super().__init__(VOCAB, eos_token_id)
        self.seen: list[dict] = []

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None, **variables) -> str:
        self.seen.append({"tools": tools, **variables})
        head = "/no_think " if variables.get("enable_thinking") is False else ""
        if tools:
            head += "tools: " + json.dumps([tool["function"]["name"] for tool in tools]) + " "
        lines = "".join(f"{m['role']}: {m['content']}|" for m in messages)
        return head + lines + ("assistant: " if add_generation_prompt else "")


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


class LineTokenizer:
    """Printable ASCII plus newline, one token per character (ids 0-94: ``chr(32 + id)``, 95: ``"\\n"``),
    and EOS (96); a chat template of ``role: content`` lines without a ``tools`` variable."""

    NEWLINE = 95
    EOS = 96
    VOCAB = 97
    max_token_chars = 1

    def __init__(self) -> None:
        self.vocab_size = self.VOCAB
        self.eos_token_ids = (self.EOS,)
        self.seen_tools: list[object] = []
        self.seen_messages: list[list[dict]] = []

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.NEWLINE if ch == "\n" else (ord(ch) - 32) % 95 for ch in text]

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        chars = []
        for t in token_ids:
            if t == self.EOS:
                chars.append("" if skip_special_tokens else "<eos>")
            else:
                chars.append("\n" if t == self.NEWLINE else chr(32 + t))
        return "".join(chars)

    def decode_raw(self, token_ids, skip_special_tokens: bool = True) -> str:
        return self.decode(token_ids, skip_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None, **_variables) -> str:
        self.seen_tools.append(tools)
        self.seen_messages.append(list(messages))
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        return "\n".join(lines) + ("\nassistant: " if add_generation_prompt else "")


class ScriptedModel(SyntheticModel):
    """A model that writes a fixed reply for each last user message (``scripts``), character by character,
    and keeps to it whatever was actually emitted: once a constraint forces another character, it goes on
    with the script's next one (a model that "tries" the script). Its logits prefer the script's character,
    then ``"``, ``}`` and EOS, so a constrained reply that left the script still ends.

    Each row's whole sequence is read back from the KV cache through the block table (the synthetic model
    stores token ids there), decoded, and split at the last ``"\\nassistant: "``: before it the prompt (whose
    last ``user: `` line picks the script), after it the reply so far.
    """

    def __init__(self, scripts: dict[str, str]):
        super().__init__(vocab_size=LineTokenizer.VOCAB, eos_token_id=LineTokenizer.EOS)
        self.scripts = scripts
        self.codec = LineTokenizer()

    @property
    def tokenizer(self) -> LineTokenizer:
        return self.codec

    def forward(self, inputs, kv_cache):
        import torch

        bs = inputs.block_size
        cache = kv_cache.keys[0].view(-1)
        cache[inputs.slot_mapping] = inputs.input_ids.to(cache.dtype)
        starts = inputs.cu_seqlens.tolist()
        positions = inputs.positions.tolist()
        tables = inputs.block_tables.long().tolist()
        rows = inputs.logits_rows.tolist()
        logits = torch.zeros(len(rows), self.vocab_size, dtype=torch.float32)
        for out, token_index in enumerate(rows):
            row = max(r for r in range(len(starts) - 1) if starts[r] <= token_index)
            position = positions[token_index]
            slots = [tables[row][q // bs] * bs + q % bs for q in range(position + 1)]
            text = self.codec.decode([int(t) for t in cache[slots].tolist()])
            for token, value in self._preferences(text).items():
                logits[out, token] = value
        return logits

    def _preferences(self, text: str) -> dict[int, float]:
        prompt, _, reply = text.rpartition("\nassistant: ")
        key = prompt.rpartition("user: ")[2]
        script = self.scripts.get(key, "")
        wanted = self.codec.encode(script[len(reply)]) if len(reply) < len(script) else [self.codec.EOS]
        preferences = {self.codec.encode('"')[0]: 3.0, self.codec.encode("}")[0]: 2.0, self.codec.EOS: 1.0}
        preferences[wanted[0]] = 8.0
        return preferences
