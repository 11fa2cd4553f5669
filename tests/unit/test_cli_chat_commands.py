"""``pagedgen chat``'s slash commands and turn counter, ``generate``'s tokens/s, ``serve``'s start-up log."""

from __future__ import annotations

import types

import pytest

import pagedgen as pg
from pagedgen import cli
from pagedgen.engine.engine import Engine
from pagedgen.models.model import Model
from tests.model.tiny_checkpoints import TINY_RAW, random_state, write_gguf


class FakeSession:
    """Records the system message it was opened with and whether it was closed."""

    def __init__(self, system):
        self.system = system
        self.closed = False

    def close(self):
        self.closed = True


def _loop(system=None):
    opened = []

    def new_session(system):
        opened.append(FakeSession(system))
        return opened[-1]

    return cli.ChatLoop(new_session, system), opened


def test_reset_opens_a_new_session_and_restarts_the_turn_counter():
    loop, opened = _loop("be brief")
    loop.turn = 3
    assert loop.command("/reset") == (True, "[new conversation]")
    assert loop.turn == 0
    assert [s.system for s in opened] == ["be brief", "be brief"]
    assert opened[0].closed and not opened[1].closed
    assert loop.session is opened[1]


def test_system_sets_or_clears_the_system_message_in_a_new_conversation():
    loop, opened = _loop()
    loop.turn = 2
    assert loop.command("/system You are a pirate.") == (
        True,
        "[system message 'You are a pirate.'; new conversation]",
    )
    assert (loop.system, loop.turn, opened[-1].system) == ("You are a pirate.", 0, "You are a pirate.")
    assert loop.command("/system") == (True, "[system message cleared; new conversation]")
    assert (loop.system, opened[-1].system, len(opened)) == (None, None, 3)


def test_help_quit_and_unknown_commands():
    loop, opened = _loop()
    assert loop.command("/help") == (True, cli.CHAT_COMMANDS)
    assert loop.command("/quit") == (False, None)
    assert loop.command("/exit") == (False, None)
    assert loop.command("/foo bar") == (
        True,
        "[unknown command /foo: not sent to the model; /help lists the commands]",
    )
    assert len(opened) == 1 and loop.turn == 0  # none of them opened a session or counted a turn


def test_a_slash_starts_a_command_and_a_double_slash_escapes_it():
    assert cli.split_chat_line("  /reset  ") == (True, "/reset")
    assert cli.split_chat_line("/system Be terse.") == (True, "/system Be terse.")
    assert cli.split_chat_line("//etc/hosts is a file") == (False, "/etc/hosts is a file")
    assert cli.split_chat_line("what is 1/2?") == (False, "what is 1/2?")
    assert cli.split_chat_line("   ") == (False, "   ")


def test_throughput_line_counts_generated_tokens_per_second():
    outputs = [
        types.SimpleNamespace(prompt_token_ids=[1, 2, 3], token_ids=[4, 5, 6, 7]),
        types.SimpleNamespace(prompt_token_ids=[1], token_ids=[8, 9, 10, 11, 12, 13]),
    ]
    assert cli.throughput_line(outputs, 2.0) == (
        "[2 prompts: 4 prompt tokens, 10 generated tokens in 2.00 s, 5.0 tokens/s]"
    )
    assert cli.throughput_line(outputs[:1], 0.5) == (
        "[1 prompt: 3 prompt tokens, 4 generated tokens in 0.50 s, 8.0 tokens/s]"
    )


@pytest.fixture
def tiny_model(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDGEN_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "llama", random_state(TINY_RAW), TINY_RAW)
    return Model(str(path), device="cpu")


def test_startup_lines_name_the_model_id_context_cache_weights_and_memory(tiny_model, monkeypatch):
    config = pg.EngineConfig(num_blocks=40, block_size=16)
    engine = Engine(tiny_model, config)
    snapshot = types.SimpleNamespace(total_blocks=engine.num_blocks)
    options = types.SimpleNamespace(model_name="default")
    monkeypatch.setattr(cli, "resident_bytes", lambda: 300 << 20)
    per_block = tiny_model.kv_spec.bytes_per_block(16)
    assert cli.startup_lines(tiny_model, config, options, snapshot) == [
        'model id to send: "default" (GET /v1/models lists it)',
        "context length: 256 tokens per request",
        f"KV cache: 40 blocks of 16 tokens, {40 * per_block / (1 << 20):.1f} MiB",
        "weights: native (native kernels available), dtype float32",
        "resident memory: 300.0 MiB",
    ]
    engine.close()


def test_resident_bytes_is_this_process_rss():
    with open("/proc/self/status") as status:
        rss_kib = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    assert abs(cli.resident_bytes() - rss_kib * 1024) < 64 << 20  # read a moment apart: within 64 MiB
