"""The server's text ends exactly at the stop string, streaming or not, when the stop string begins inside a
token: the text of that token before the stop string is returned, nothing after it is ever streamed.

Model: the synthetic model with two-character tokens (``tests/pieces.py``), whose greedy text is known.
"""

from __future__ import annotations

import openai
import pytest

import pagedgen as pg
from pagedgen.server.app import ServerOptions, build_app
from tests.pieces import PiecesModel
from tests.server.live import LiveServer

PROMPT = [11, 12, 13]  # greedy text: "F" "a" "xA" "aE" "m" "E" "mB" "rD" "w" "J"
UTF8 = {118: b"x\xc3", 199: b"\xa9!"}  # "xA" "aE" become "x" + half of "é", the rest of "é" + "!"
# (pieces, stop, expected text): stop strings that straddle two tokens or lie inside one
CASES = [
    ({}, "Aa", "Fax"),
    ({}, "E", "FaxAa"),
    (UTF8, "é!", "Fax"),
    (UTF8, "!", "Faxé"),
]


@pytest.fixture(params=[{}, UTF8], ids=["ascii", "utf8"])
def served(request):
    model = PiecesModel(pieces=request.param)
    config = pg.EngineConfig(max_batch_size=8, num_blocks=64, debug_invariants=True)
    server = LiveServer(build_app(model, config, ServerOptions(model_name="pieces"))).start()
    yield server, [(stop, text) for pieces, stop, text in CASES if pieces == request.param]
    server.stop()


def _complete(server: LiveServer, stop: str, stream: bool):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return client.completions.create(
        model="pieces", prompt=PROMPT, max_tokens=10, temperature=0, stop=[stop], stream=stream
    )


def test_completion_text_is_cut_exactly_at_the_stop_string(served):
    server, cases = served
    for stop, expected in cases:
        response = _complete(server, stop, stream=False)
        assert (response.choices[0].text, response.choices[0].finish_reason) == (expected, "stop")


def test_streamed_text_is_cut_exactly_at_the_stop_string(served):
    """Chunks concatenate to the cut text: nothing past the stop string is streamed, not even for a moment."""
    server, cases = served
    for stop, expected in cases:
        chunks = list(_complete(server, stop, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == expected
        assert [c.choices[0].finish_reason for c in chunks][-1] == "stop"


@pytest.mark.parametrize("pieces, stop, expected", CASES)
def test_the_cases_cut_inside_a_token(pieces, stop, expected):
    """Every case's cut falls inside a token: its text before the stop string is not on any TOKEN event."""
    model = PiecesModel(pieces=pieces)
    tokens = model.greedy(PROMPT, 10)
    text = model.tokenizer.decode(tokens)
    assert text[: text.find(stop)] == expected
    assert expected not in {model.tokenizer.decode(tokens[:k]) for k in range(len(tokens) + 1)}
