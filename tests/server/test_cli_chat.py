"""``pagedgen chat`` driven through a pseudo-terminal: two turns on the default model, and the line editing,
slash commands and turn counter on a tiny GGUF model.

The second turn must continue the same engine Request: its prompt is only the new fragment the chat template
adds (end of the previous reply, the new user message, the generation prompt), not the whole conversation.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pexpect
import pytest

import pagedgen as pg
from pagedgen.cli import CHAT_COMMANDS, CHAT_HELP
from tests.model.tiny_checkpoints import TINY_RAW, random_state, write_gguf

MAX_TOKENS = 8
# Loading the model in the child process is the slow part; this bounds a hung child, it times nothing.
EXPECT_TIMEOUT_S = 900
STATS = re.compile(rb"\[turn (\d): prompt_tokens=(\d+) generated_tokens=(\d+) finish_reason=(\w+)\]")


def _reply(child: pexpect.spawn) -> tuple[str, tuple[int, int, int, str]]:
    """The streamed reply (everything up to the stats line) and the parsed stats."""
    child.expect(STATS, timeout=EXPECT_TIMEOUT_S)
    text = child.before.decode("utf-8").replace("\r\n", "\n").strip("\n")
    turn, prompt_tokens, generated, finish = child.match.groups()
    return text, (int(turn), int(prompt_tokens), int(generated), finish.decode())


@pytest.mark.model
def test_chat_two_turns_in_one_request(reference_llm):
    pagedgen = Path(sys.executable).with_name("pagedgen")
    child = pexpect.spawn(
        str(pagedgen),
        ["chat", "--max-tokens", str(MAX_TOKENS), "--num-blocks", "64", "--stats"],
        env={**os.environ, "TERM": "dumb"},
        echo=False,
        timeout=EXPECT_TIMEOUT_S,
    )
    try:
        child.expect_exact(CHAT_HELP)
        child.expect_exact(">>> ")
        child.sendline("Hi")
        first_text, first_stats = _reply(child)
        child.expect_exact(">>> ")
        child.sendline("What is your name?")
        second_text, second_stats = _reply(child)
        child.expect_exact(">>> ")
        reused = re.search(rb"\[cached_tokens=(\d+)\]", child.before)  # after turn 2's stats line
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0

    tokenizer = reference_llm.tokenizer
    first_messages = [{"role": "user", "content": "Hi"}]
    first_prompt = reference_llm.render_chat(first_messages)
    expected = reference_llm.chat(
        first_messages, pg.SamplingParams(max_tokens=MAX_TOKENS, temperature=0), use_tqdm=False
    )
    assert first_text == expected[0].text
    assert first_stats == (
        1,
        len(tokenizer.encode(first_prompt)),
        len(expected[0].token_ids),
        expected[0].finish_reason,
    )

    # Turn 2 prefilled only what the template adds after the first reply.
    conversation = [
        *first_messages,
        {"role": "assistant", "content": first_text},
        {"role": "user", "content": "What is your name?"},
    ]
    full = reference_llm.render_chat(conversation)
    held = first_prompt + first_text
    assert full.startswith(held)
    assert second_stats[0] == 2
    assert second_stats[1] == len(tokenizer.encode(full[len(held) :]))
    assert second_stats[1] < len(tokenizer.encode(full)) // 2
    # ... and reused the conversation held in the KV cache: everything before that fragment but the last
    # generated token (its K/V are written by the continuation's first step).
    assert (
        reused is not None
        and int(reused.group(1)) == len(tokenizer.encode(first_prompt)) + first_stats[2] - 1
    )
    # ... and equals a fresh request over the concatenated tokens (turn 1 prompt + reply + fragment).
    concatenated = (
        tokenizer.encode(first_prompt) + expected[0].token_ids + tokenizer.encode(full[len(held) :])
    )
    fresh = reference_llm.generate(
        [concatenated], pg.SamplingParams(max_tokens=MAX_TOKENS, temperature=0), use_tqdm=False
    )
    assert second_text == fresh[0].text
    assert second_stats[2:] == (len(fresh[0].token_ids), fresh[0].finish_reason)


UP = "\x1b[A"  # the Up arrow as a terminal sends it
TURN = re.compile(rb"\[turn (\d+): prompt_tokens=\d+ generated_tokens=\d+ finish_reason=\w+\]")
UNKNOWN_FOO = "[unknown command /foo: not sent to the model; /help lists the commands]"


def test_chat_line_editing_slash_commands_and_turn_counter(tmp_path):
    model = tmp_path / "tiny.gguf"
    write_gguf(model, "llama", random_state(TINY_RAW), TINY_RAW)
    pagedgen = Path(sys.executable).with_name("pagedgen")
    child = pexpect.spawn(
        str(pagedgen),
        ["chat", "--model", str(model), "--max-tokens", "3", "--num-blocks", "32", "--stats"],
        env={**os.environ, "TERM": "dumb", "PAGEDGEN_CACHE_DIR": str(tmp_path / "cache")},
        echo=False,
        timeout=EXPECT_TIMEOUT_S,
    )
    turns = []
    try:
        child.expect_exact(CHAT_HELP)
        child.expect_exact(">>> ")
        child.sendline("/help")
        child.expect_exact(CHAT_COMMANDS.replace("\n", "\r\n"))
        child.expect_exact(">>> ")
        child.sendline("hello")
        child.expect(TURN)
        turns.append(int(child.match.group(1)))
        child.expect_exact(">>> ")
        child.sendline("/foo")  # refused here: no turn, nothing sent to the model
        child.expect_exact(UNKNOWN_FOO)
        child.expect_exact(">>> ")
        assert TURN.search(child.before) is None
        child.send(UP + "\r")  # recalls "/foo" (without readline it would send "^[[A" as a message)
        index = child.expect([re.escape(UNKNOWN_FOO.encode()), TURN])
        assert index == 0
        child.expect_exact(">>> ")
        child.send(UP + UP + "\r")  # two lines back: "hello", a second turn
        child.expect(TURN)
        turns.append(int(child.match.group(1)))
        child.expect_exact(">>> ")
        child.sendline("/reset")
        child.expect_exact("[new conversation]")
        child.expect_exact(">>> ")
        child.sendline("again")
        child.expect(TURN)
        turns.append(int(child.match.group(1)))
        child.expect_exact(">>> ")
        child.sendline("/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert turns == [1, 2, 1]  # the counter restarts with the conversation
    assert child.exitstatus == 0
