"""Costly constraints (issue 24): parser limits, the first-mask check, byte-bounded caches, the mask budget.

A grammar over llguidance's parser limits is refused when its matcher is first built, with llguidance's
reason, before any engine step would compute its masks; the caches of compiled specs and matchers are
bounded by the bytes they are charged; and a mask that is not ready within its step budget fails its own
row alone while the other rows of the step get their exact masks.
"""

from __future__ import annotations

import json
import threading

import pytest

from pagedgen.errors import GuidanceError
from pagedgen.guidance import compile_guidance, cursor, spec
from pagedgen.guidance.cursor import GrammarCursor, compiled_matcher
from pagedgen.guidance.lru import BoundedLru
from pagedgen.guidance.masks import MaskComputer, MaskRow
from pagedgen.guidance.spec import parser_limits
from pagedgen.guidance.tokenizer import guidance_tokenizer
from pagedgen.models.synthetic import SyntheticModel
from tests.helpers import RECURSIVE

V = 257
EOS = 256
CHOICES = "start: " + " | ".join(json.dumps(f"c{i}") for i in range(20_000))


@pytest.fixture(scope="module")
def model() -> SyntheticModel:
    return SyntheticModel(vocab_size=V, eos_token_id=EOS)


def test_the_parser_limits_are_the_documented_ones():
    limits = parser_limits()
    assert (limits.max_items_in_row, limits.initial_lexer_fuel, limits.step_lexer_fuel) == (
        2_000,
        200_000,
        200_000,
    )
    assert (limits.step_max_items, limits.max_lexer_states, limits.max_grammar_size) == (
        50_000,
        100_000,
        500_000,
    )
    assert limits.verbose_errors is False  # the message goes to a client: no parser state dump


@pytest.mark.parametrize(
    ("kind", "data", "reason"),
    [
        ("regex", "(a{1000}){999}", "lexer error: too many expressions constructed"),
        ("lark_grammar", CHOICES, "Current row has 20001 items; max is 2000"),
        ("json_schema", RECURSIVE, "Too many items (limit 50000; ff_tokens)"),
    ],
    ids=["nested-repeat", "20k-choices", "recursive-required-ref"],
)
def test_a_grammar_over_a_parser_limit_is_refused_when_first_built(model, kind, data, reason):
    guidance = compile_guidance(kind, data)  # compiles on its own: the limits bite on its masks
    with pytest.raises(GuidanceError, match="the grammar exceeds a parser limit") as refused:
        GrammarCursor.for_model(model, guidance)
    assert reason in str(refused.value) and "\n" not in str(refused.value)
    tokenizer = guidance_tokenizer(model, json=kind == "json_schema")
    assert cursor._compiled.get((id(tokenizer), guidance.grammar)) is None  # refusals are not cached


def test_a_first_mask_over_its_budget_is_refused(model, monkeypatch):
    monkeypatch.setattr(cursor, "FIRST_MASK_BUDGET_S", 0.0)
    guidance = compile_guidance("regex", "[a-z]{3}(x|y)[0-9]{5,9}")
    with pytest.raises(GuidanceError, match=r"first token masks took .* s; the budget is 0.0 s"):
        GrammarCursor.for_model(model, guidance)


def test_forced_tokens_are_walked_and_a_complete_grammar_stops_the_walk(model):
    tokenizer = guidance_tokenizer(model)
    matcher = compiled_matcher(tokenizer, compile_guidance("regex", "abc").grammar)
    assert (
        not matcher.is_error()
        and matcher.compute_bitmask()
        == GrammarCursor(compile_guidance("regex", "abc"), matcher.deep_copy(), V).allowed_bitmask()
    )  # the walk ran on a copy: the cached matcher is pristine


def test_the_spec_memo_is_bounded_by_bytes(monkeypatch):
    memo = BoundedLru(128, 3_000)
    monkeypatch.setattr(spec, "_specs", memo)
    specs = [compile_guidance("regex", f"{letter}{{1,3}}" + "x" * 400) for letter in "abcdef"]
    charged = [len(s.data) + len(s.grammar) for s in specs]
    assert memo.num_bytes <= 3_000 and len(memo) < len(specs)
    kept = [s for s in specs if memo.get((s.kind, s.data)) is s]
    assert kept == specs[-len(kept) :] and memo.num_bytes == sum(charged[-len(kept) :])


def test_the_compiled_matcher_cache_is_bounded_by_bytes(model, monkeypatch):
    matchers = BoundedLru(128, 40_000)
    monkeypatch.setattr(cursor, "_compiled", matchers)
    tokenizer = guidance_tokenizer(model)
    grammars = [compile_guidance("regex", f"{n}" + "y" * 300).grammar for n in range(8)]
    for grammar in grammars:
        compiled_matcher(tokenizer, grammar)
    costs = [len(g) * cursor.MATCHER_BYTES_PER_GRAMMAR_BYTE for g in grammars]
    assert matchers.num_bytes <= 40_000 and 0 < len(matchers) < len(grammars)
    assert matchers.num_bytes == sum(costs[-len(matchers) :])
    assert matchers.get((id(tokenizer), grammars[-1])) is not None
    assert matchers.get((id(tokenizer), grammars[0])) is None


def test_the_lru_drops_the_least_recently_used_and_never_stores_what_cannot_fit():
    lru = BoundedLru(3, 100)
    for key in "abc":
        lru.put(key, key.upper(), 30)
    assert lru.get("a") == "A"  # now the most recent: "b" goes first
    lru.put("d", "D", 30)
    assert [lru.get(k) for k in "abcd"] == ["A", None, "C", "D"] and lru.num_bytes == 90
    lru.put("big", "X", 101)
    assert lru.get("big") is None and lru.num_bytes == 90
    lru.put("e", "E", 60)  # over 100 bytes: drops "a" and "c", the oldest
    assert [lru.get(k) for k in "acde"] == [None, None, "D", "E"] and lru.num_bytes == 90
    with pytest.raises(ValueError, match="max_entries and max_bytes >= 1"):
        BoundedLru(0, 10)


def test_a_mask_past_its_budget_fails_its_row_alone_and_the_pool_is_replaced(model):
    email = compile_guidance("regex", r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)")
    digits = compile_guidance("regex", r"[0-9]{4}")
    slow, fast, other = (GrammarCursor.for_model(model, g) for g in (email, digits, email))
    gate = threading.Event()
    computer = MaskComputer(num_threads=2, budget_s=0.2, hold=lambda rid: rid == 1 and gate.wait(60))
    try:
        pending = computer.submit([MaskRow(1, slow, 0), MaskRow(2, fast, 1), MaskRow(3, other, 2)])
        result = pending.result()
        assert [rid for rid, _ in result.failed] == [1]
        assert "not ready within the step budget of 0.2 s" in str(result.failed[0][1])
        assert slow.error == "the constraint's token mask was not ready within the step budget of 0.2 s"
        assert fast.error is None and other.error is None
        assert result.masks.bitmask[1].numpy().tobytes() == fast.allowed_bitmask()
        assert result.masks.bitmask[2].numpy().tobytes() == other.allowed_bitmask()
        assert computer.abandoned_pools == 1
        again = computer.submit([MaskRow(2, fast, 0)]).result()  # a fresh pool: not behind the late task
        assert again.failed == [] and again.masks.bitmask[0].numpy().tobytes() == fast.allowed_bitmask()
        assert computer.abandoned_pools == 1
    finally:
        gate.set()
        computer.close()
