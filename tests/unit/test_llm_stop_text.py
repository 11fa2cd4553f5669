"""``pg.LLM.generate`` and ``ChatSession`` return the text exactly up to the stop string, including the part
of the token in which it begins (synthetic model with two-character tokens, ``tests/pieces.py``)."""

from __future__ import annotations

import pytest

import pagedgen as pg
from pagedgen.cli import _chat_turn
from tests.pieces import PiecesModel, straddling_stop

PROMPT = [11, 12, 13]  # greedy text: "F" "a" "xA" "aE" "m" "E" "mB" "rD" "w" "J"


def make_llm(pieces: dict[int, bytes] | None = None) -> pg.LLM:
    config = pg.EngineConfig(max_batch_size=8, num_blocks=64, debug_invariants=True)
    return pg.LLM(PiecesModel(pieces=pieces or {}), config)


def greedy(max_tokens: int | None, **kwargs) -> pg.SamplingParams:
    return pg.SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)


@pytest.mark.parametrize(
    "stop, text, token_ids",
    [("Aa", "Fax", [38, 65]), ("E", "FaxAa", [38, 65, 118]), ("xA", "Fa", [38, 65]), ("F", "", [])],
)
def test_generate_cuts_the_text_at_the_stop_string(stop, text, token_ids):
    [out] = make_llm().generate([PROMPT], greedy(10, stop=("never", stop)), use_tqdm=False)
    assert (out.text, out.token_ids, out.finish_reason, out.stop_reason) == (text, token_ids, "stop", stop)


def test_generate_completes_a_character_split_across_tokens():
    llm = make_llm({118: b"x\xc3", 199: b"\xa9!"})
    [out] = llm.generate([PROMPT], greedy(10, stop=("!",)), use_tqdm=False)
    assert (out.text, out.token_ids) == ("Faxé", [38, 65])


def _chat_reference(llm: pg.LLM, user: str) -> tuple[str, str]:
    """A stop string that begins inside a token of the greedy reply to ``user``, and the reply cut there."""
    rendered = llm.render_chat([{"role": "user", "content": user}])
    return straddling_stop(llm.tokenizer, llm.model.greedy(llm.tokenizer.encode(rendered), 16))


def test_chat_session_streams_and_records_the_cut_reply():
    llm = make_llm()
    stop, reply = _chat_reference(llm, "Hi")
    assert (stop, reply) == ("Co", "o")  # the reply's first token "oC" straddles the stop string
    session = llm.start_chat(greedy(16, stop=(stop,)))
    assert "".join(session.send("Hi")) == reply
    assert (session.last.text, session.last.finish_reason) == (reply, "stop")
    assert session.messages[-1] == {"role": "assistant", "content": reply}
    session.close()


def test_pagedgen_chat_prints_the_cut_reply(capsys):
    llm = make_llm()
    stop, reply = _chat_reference(llm, "Hi")
    session = llm.start_chat(greedy(16, stop=(stop,)))
    _chat_turn(session, "Hi", 1, stats=True)
    assert (
        capsys.readouterr().out
        == f"{reply}\n[turn 1: prompt_tokens=20 generated_tokens=2 finish_reason=stop]\n"
    )
    session.close()


def test_chat_turn_after_a_stop_string_renders_the_conversation_afresh():
    """The Request still holds the stop string's tokens, which the recorded reply does not: the next turn
    must not continue that Request (the model would see text the conversation does not have)."""
    llm = make_llm()
    stop, reply = _chat_reference(llm, "Hi")
    session = llm.start_chat(greedy(16, stop=(stop,)))
    list(session.send("Hi"))
    list(session.send("Yo"))
    conversation = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "Yo"},
    ]
    assert session.last.prompt_tokens == len(llm.tokenizer.encode(llm.render_chat(conversation)))
    session.close()


def test_chat_turn_after_a_length_finish_continues_the_request():
    llm = make_llm()
    session = llm.start_chat(greedy(4))
    first = "".join(session.send("Hi"))
    list(session.send("Yo"))
    rendered = llm.render_chat([{"role": "user", "content": "Hi"}])
    fragment = llm.render_chat(
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": first},
            {"role": "user", "content": "Yo"},
        ]
    )[len(rendered) + len(first) :]
    assert session.last.prompt_tokens == len(fragment)
    session.close()


def test_chat_session_reuses_the_conversation_and_survives_losing_residency(capsys):
    """Turn 2 continues the resident Request (its history is reused); when another conversation takes the
    engine's only slot, the next turn is re-admitted from the prefix cache with the same reply."""

    def conversation(llm: pg.LLM) -> list:
        session = llm.start_chat(greedy(6))
        replies = ["".join(session.send("Hi"))]
        replies.append("".join(session.send("Yo")))
        assert session.last.cached_tokens > 0  # the history was not recomputed
        other = llm.start_chat(greedy(6))
        list(other.send("Hey"))  # needs the slot: the first conversation's Request yields
        replies.append("".join(session.send("Ok")))
        cached = session.last.cached_tokens
        session.close()
        other.close()
        return replies, cached

    single = pg.LLM(PiecesModel(), pg.EngineConfig(max_batch_size=1, num_blocks=64, debug_invariants=True))
    roomy = pg.LLM(PiecesModel(), pg.EngineConfig(max_batch_size=4, num_blocks=64, debug_invariants=True))
    replies, cached = conversation(single)
    assert single.engine.stats().idle_evictions >= 1 and cached > 0  # re-admitted from the prefix cache
    assert replies == conversation(roomy)[0]
    session = roomy.start_chat(greedy(6))
    list(session.send("Hi"))
    _chat_turn(session, "Yo", 2, stats=True)
    out = capsys.readouterr().out
    assert f"finish_reason=length] [cached_tokens={session.last.cached_tokens}]\n" in out
    session.close()
