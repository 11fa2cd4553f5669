"""Hostile-input suite, costly constraints (issue 24): each probe is a clear 400, a neighbour keeps streaming.

Each probe was accepted before and then held every engine step for seconds on llguidance, ending in a 500
whose cause was logged nowhere. Now a constraint over llguidance's parser limits is refused before
admission (a 400 naming the param, with llguidance's reason, and nothing reaches the engine), and one that
gets costly only later fails alone during generation (a 400 ``guidance_failed``, or an error event in a
stream). A streaming neighbour started before each probe emits exactly its solo text, and every block is
free afterwards. Loopback only, on the synthetic model; every request is bounded in tokens.
"""

from __future__ import annotations

import json
import random
import threading

import httpx
import pytest

from pagedgen.models.synthetic import SyntheticModel
from tests.helpers import RECURSIVE
from tests.server.doubles import VOCAB, ChatTokenizer, app_state, expected_text, serve_counting_submits

NEIGHBOUR_PROMPT = [5, 6, 7]
NEIGHBOUR_TOKENS = 300


def mib_regex() -> str:
    """An alternation of random 8-letter words, just under 1 MiB of text (the size limit lets it in)."""
    rnd = random.Random(0)
    words, size = [], 2
    while size + 9 < 1 << 20:
        words.append("".join(rnd.choice("abcdefghij") for _ in range(8)))
        size += 9
    return "(" + "|".join(words) + ")"


CHAT = [{"role": "user", "content": "Hi"}]
# (route, body fields, the param the 400 names, llguidance's reason in its message)
PROBES = [
    ("/v1/completions", {"structured_outputs": {"regex": "(a{1000}){999}"}}, "structured_outputs.regex",
     "too many expressions constructed"),
    ("/v1/completions", {"structured_outputs": {"grammar": 'start: ("a"{1000}){999}\n'}},
     "structured_outputs.grammar", "Too many items"),
    ("/v1/completions", {"structured_outputs": {"choice": [f"c{i}" for i in range(20_000)]}},
     "structured_outputs.choice", "Current row has 20001 items; max is 2000"),
    ("/v1/completions", {"structured_outputs": {"regex": mib_regex()}}, "structured_outputs.regex",
     "initial lexer configuration (grammar) too big"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "n", "schema": RECURSIVE}}},
     "response_format.json_schema.schema", "Too many items"),
    ("/v1/chat/completions", {"tools": [{"type": "function",
                                         "function": {"name": "f", "parameters": RECURSIVE}}],
                              "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tools[0].function.parameters", "Too many items"),
]  # fmt: skip
PROBE_IDS = ["nested-repeat-regex", "exponential-lark", "20k-choices", "1mib-regex", "recursive-schema",
             "recursive-tool"]  # fmt: skip


@pytest.fixture(scope="module")
def server():
    live = serve_counting_submits(SyntheticModel(vocab_size=VOCAB), ChatTokenizer(VOCAB))
    yield live
    live.stop()


class Neighbour:
    """A streaming completion on its own thread; ``started`` is set at its first content chunk."""

    def __init__(self, server):
        self.started = threading.Event()
        self.text: list[str] = []
        self.events: list[str] = []
        body = {
            "model": "synthetic",
            "prompt": NEIGHBOUR_PROMPT,
            "max_tokens": NEIGHBOUR_TOKENS,
            "stream": True,
            "temperature": 0,
        }
        self._thread = threading.Thread(target=self._run, args=(server.url, body), daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line.removeprefix("data: ")
                    self.events.append(data)
                    if data != "[DONE]":
                        self.text.append(json.loads(data)["choices"][0]["text"])
                        self.started.set()
        finally:
            self.started.set()

    def join(self) -> str:
        self._thread.join(timeout=120)
        assert not self._thread.is_alive(), "the neighbour stream never ended"
        return "".join(self.text)


def settled_snapshot(server):
    done = threading.Event()
    found = []
    app_state(server).worker.sync(lambda snapshot: (found.append(snapshot), done.set()))
    assert done.wait(timeout=120)
    return found[0]


def post(server, path: str, body: dict) -> httpx.Response:
    prompt = {"messages": CHAT} if path.endswith("chat/completions") else {"prompt": "ab"}
    return httpx.post(
        server.url + path, json={"model": "synthetic", "max_tokens": 20, **prompt, **body}, timeout=120
    )


def assert_neighbour_streamed_exactly(neighbour: Neighbour) -> None:
    assert neighbour.join() == expected_text(NEIGHBOUR_PROMPT, NEIGHBOUR_TOKENS)
    assert neighbour.events[-1] == "[DONE]"
    assert json.loads(neighbour.events[-2])["choices"][0]["finish_reason"] == "length"


def assert_every_block_free(server) -> None:
    snapshot = settled_snapshot(server)
    assert snapshot.healthy and snapshot.jobs == 0
    assert snapshot.free_blocks == snapshot.total_blocks


@pytest.mark.parametrize(("path", "fields", "param", "reason"), PROBES, ids=PROBE_IDS)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_costly_constraint_is_400_naming_its_param_with_llguidance_s_reason(
    server, path, fields, param, reason, stream
):
    neighbour = Neighbour(server)
    assert neighbour.started.wait(timeout=120)
    before = len(server.submitted)
    response = post(server, path, {"stream": stream, **fields})
    assert response.status_code == 400, response.text[:500]
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert reason in error["message"], error["message"][:500]
    assert len(server.submitted) == before, "a refused request reached the engine worker"
    assert_neighbour_streamed_exactly(neighbour)
    assert_every_block_free(server)


# Passes the first-mask check (its first token is a free choice); the mask after "x" is the costly one.
LATE = {"structured_outputs": {"regex": "(x|y)(a{1000}){999}"}}
LATE_PREFIX = "the output constraint failed during generation: guidance failed: "


def test_a_constraint_costly_only_later_fails_alone_as_a_400(server):
    neighbour = Neighbour(server)
    assert neighbour.started.wait(timeout=120)
    response = post(server, "/v1/completions", LATE)
    assert response.status_code == 400, response.text[:500]
    error = response.json()["error"]
    assert error["code"] == "guidance_failed" and error["message"].startswith(LATE_PREFIX), error
    assert_neighbour_streamed_exactly(neighbour)
    assert_every_block_free(server)


def test_a_constraint_costly_only_later_ends_its_stream_with_an_error_event(server):
    neighbour = Neighbour(server)
    assert neighbour.started.wait(timeout=120)
    response = post(server, "/v1/completions", {"stream": True, **LATE})
    assert response.status_code == 200
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "guidance_failed" and error["message"].startswith(LATE_PREFIX), error
    assert_neighbour_streamed_exactly(neighbour)
    assert_every_block_free(server)
