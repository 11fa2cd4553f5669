"""The text before a stop string, on the engine's events: token granularity plus ``text_before_stop``.

A token in which a stop string begins is never a TOKEN event; the part of its text before the stop string
travels on the TURN_FINISHED event, so decode(TOKEN events) + ``text_before_stop`` is the generated text cut
exactly at the stop string. Model: the synthetic model with two-character tokens (``tests/pieces.py``); for
prompt [11, 12, 13] its greedy text is "F" "a" "xA" "aE" "m" "E" "mB" "rD" "w" "J".
"""

from __future__ import annotations

import pytest

import pagedgen as pg
from pagedgen.engine.faults import FaultInjector
from tests.helpers import drain, finishes_of, make_engine, submit, tokens_of
from tests.pieces import PiecesModel

PROMPT = [11, 12, 13]
F = pg.EngineEventFlags


def _run(stops: list[str], model: PiecesModel | None = None, **config) -> tuple[list[int], pg.EngineEvent]:
    """Greedy turn of PROMPT with ``stops``; returns its TOKEN payloads and its TURN_FINISHED event."""
    engine = make_engine(model or PiecesModel(), **config)
    request = submit(engine, PROMPT, 10, stop_strings=stops)
    events = drain(engine)
    (finish,) = finishes_of(events)[request]
    return tokens_of(events)[request], finish


def _text_cut_at(model: PiecesModel, stop: str) -> str:
    text = model.tokenizer.decode(model.greedy(PROMPT, 10))
    assert stop in text
    return text[: text.find(stop)]


@pytest.mark.parametrize(
    "stops, tokens, before, matched",
    [
        (["Aa"], [38, 65], "x", 0),  # "xA" straddles the start of "Aa"
        (["E"], [38, 65, 118], "a", 0),  # the stop string lies inside "aE"
        (["aE", "AaE"], [38, 65], "x", 1),  # both end in "aE": the earlier start ("AaE") wins
        (["xA"], [38, 65], "", 0),  # the stop string starts on a token boundary
        (["Dw"], [38, 65, 118, 199, 77, 37, 133], "r", 0),  # "rD" is held whole: "D" may start "Dw"
    ],
)
def test_text_before_stop_completes_the_emitted_tokens(stops, tokens, before, matched):
    model = PiecesModel()
    emitted, finish = _run(stops, model)
    assert (emitted, finish.text_before_stop, finish.matched_stop_string_index) == (tokens, before, matched)
    assert finish.finish_reason is pg.FinishReason.STOP_SEQUENCE and not finish.flags & F.TOKEN
    assert model.tokenizer.decode(emitted) + before == _text_cut_at(model, stops[matched])


def test_a_character_split_across_tokens_comes_back_whole():
    """'x' + the first byte of 'é' is held (no text yet); the next token completes 'é' and holds '!'."""
    model = PiecesModel(pieces={118: b"x\xc3", 199: b"\xa9!"})
    emitted, finish = _run(["!"], model)
    assert (emitted, finish.text_before_stop) == ([38, 65], "xé")
    assert model.tokenizer.decode(emitted) + finish.text_before_stop == "Faxé" == _text_cut_at(model, "!")


def test_other_endings_carry_no_stop_text():
    emitted, finish = _run(["never"])
    assert finish.finish_reason is pg.FinishReason.MAX_GENERATED_TOKENS
    assert (len(emitted), finish.text_before_stop) == (10, "")


def test_static_path_carries_the_same_text():
    assert _run(["Aa"], dynamic_batching=False)[1].text_before_stop == "x"


@pytest.mark.parametrize("phase", ["stage", "validate"])
def test_rollback_of_the_matching_step_replays_the_same_text(phase):
    """The matcher's state is checkpointed: a retried step matches again and reports the same text."""
    faults = FaultInjector()
    engine = make_engine(PiecesModel(), faults=faults)
    request = submit(engine, PROMPT, 10, stop_strings=["Aa"])
    events = []
    for _ in range(3):  # prefill (token 0) and two decodes: "F" "a" "xA" are staged, "xA" held
        events += engine.run(max_events=64)
    assert request.sequence_length == len(PROMPT) + 3 and tokens_of(events)[request] == [38, 65]
    faults.arm(phase)
    (rolled_back,) = engine.run(max_events=64)
    assert rolled_back.flags == F.RETRYABLE and rolled_back.request is None
    events += drain(engine)
    (finish,) = finishes_of(events)[request]
    assert (tokens_of(events)[request], finish.text_before_stop) == ([38, 65], "x")
    assert engine.stats().rollbacks == 1
