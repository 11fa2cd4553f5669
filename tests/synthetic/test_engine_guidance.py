"""Constrained decoding (llguidance) on the synthetic model: every guided output matches its grammar.

The synthetic tokenizer spells token t as ``chr(32 + t % 95)`` (EOS 256 is special), so regexes and Lark
grammars over printable ASCII constrain it like a real vocabulary. The model's greedy token is a closed
formula: a mask that lets it through keeps it, one that does not forces another allowed token, so guided
outputs differ from the unguided ones and are checked with ``re.fullmatch`` (or a parser for the Lark
grammar). Unguided requests batched with guided ones emit exactly what they emit alone.
"""

from __future__ import annotations

import re

import pytest

import pagedgen as pg
from tests.helpers import (
    VOCAB,
    drain,
    expected_greedy,
    finishes_of,
    make_engine,
    synthetic_model,
    tokens_of,
    turn_options,
)

F = pg.EngineEventFlags
E = pg.EngineErrorCode
R = pg.FinishReason
EOS = 256

EMAIL = r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"
NUMBERS = r"\[[0-9]{1,3}(,[0-9]{1,3}){2,5}\]"
WORDS = r"(cat|dog|bird)( (cat|dog|bird)){3}"
REGEXES = [EMAIL, NUMBERS, WORDS]

# A Lark grammar (rules, terminals, alternatives) and the regular expression of the same language.
LARK = r"""
start: item ("," item)~2 ";"
item: KEY "=" value
value: NUMBER | "[" NUMBER ("|" NUMBER)? "]"
KEY: /[a-z]{2}/
NUMBER: /[0-9]{1,2}/
"""
_ITEM = r"[a-z]{2}=([0-9]{1,2}|\[[0-9]{1,2}(\|[0-9]{1,2})?\])"
LARK_LANGUAGE = rf"{_ITEM}(,{_ITEM}){{2}};"


def model(eos: int | None = EOS) -> pg.Model:
    return synthetic_model(eos_token_id=eos)


def guided(
    engine: pg.Engine,
    prompt: list[int],
    kind: str | None,
    data: str = "",
    max_new: int = 60,
    **search,
) -> pg.Request:
    """A request whose params carry ``kind``/``data`` guidance (None: unguided), first turn begun."""
    params = pg.GeneratorParams(engine.model)
    if search:
        params.set_search_options(**search)
    if kind is not None:
        params.set_guidance(kind, data)
    request = engine.create_request(params)
    request.begin_turn(prompt, turn_options(request, max_new))
    return request


def text(engine: pg.Engine, tokens: list[int]) -> str:
    return engine.model.tokenizer.decode(tokens)


PROMPTS = [[5, 6, 7], [40, 41], [9, 80, 3, 11], [70]]


# -- outputs match their grammar ---------------------------------------------------------------------


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_regex_outputs_fully_match_in_a_batch_with_unguided_requests(sampled):
    engine = make_engine(model(), block_size=4)
    search = {"do_sample": True, "temperature": 1.5, "seed": 7} if sampled else {}
    guided_requests = {
        guided(engine, prompt, "regex", regex, **search): regex for prompt in PROMPTS[:2] for regex in REGEXES
    }
    free = [guided(engine, prompt, None, max_new=30) for prompt in PROMPTS]
    events = drain(engine)
    tokens, finishes = tokens_of(events), finishes_of(events)
    for request, regex in guided_requests.items():
        out = text(engine, tokens[request])
        assert re.fullmatch(regex, out), (regex, out)
        assert [e.finish_reason for e in finishes[request]] == [R.EOS]
        assert finishes[request][0].usage.generated_tokens == len(tokens[request])
    for request, prompt in zip(free, PROMPTS, strict=True):
        assert tokens[request] == expected_greedy(prompt, 30, VOCAB, EOS)
    assert engine.stats().guided_rows_masked == sum(len(tokens[r]) for r in guided_requests)


def test_guidance_changes_what_the_model_would_emit():
    """The proof that masks are applied at all: the unguided greedy text does not match, the guided does."""
    engine = make_engine(model(), block_size=4)
    free = guided(engine, [5, 6, 7], None, max_new=12)
    request = guided(engine, [5, 6, 7], "regex", EMAIL)
    tokens = tokens_of(drain(engine))
    assert not re.fullmatch(EMAIL, text(engine, tokens[free]))
    assert re.fullmatch(EMAIL, text(engine, tokens[request]))


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_lark_outputs_are_in_the_grammar_language(sampled):
    engine = make_engine(model(), block_size=4)
    search = {"do_sample": True, "temperature": 1.5} if sampled else {}
    requests = [
        guided(engine, prompt, "lark_grammar", LARK, 80, seed=i, **search) for i, prompt in enumerate(PROMPTS)
    ]
    free = guided(engine, [1, 2], None, max_new=25)
    events = drain(engine)
    tokens, finishes = tokens_of(events), finishes_of(events)
    for request in requests:
        assert re.fullmatch(LARK_LANGUAGE, text(engine, tokens[request])), text(engine, tokens[request])
        assert [e.finish_reason for e in finishes[request]] == [R.EOS]
    assert tokens[free] == expected_greedy([1, 2], 25, VOCAB, EOS)


def test_output_alone_equals_output_in_a_batch():
    alone = {}
    for regex in REGEXES:
        engine = make_engine(model(), block_size=4)
        request = guided(engine, [5, 6, 7], "regex", regex, do_sample=True, seed=3)
        alone[regex] = tokens_of(drain(engine))[request]
    engine = make_engine(model(), block_size=4, max_scheduled_tokens=16)
    batch = {guided(engine, [5, 6, 7], "regex", regex, do_sample=True, seed=3): regex for regex in REGEXES}
    guided(engine, list(range(20, 40)), None, max_new=20)  # a long prefill chunked beside them
    tokens = tokens_of(drain(engine))
    assert {regex: tokens[r] for r, regex in batch.items()} == alone
