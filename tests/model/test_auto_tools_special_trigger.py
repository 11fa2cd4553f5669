"""A tool-call trigger that is a special token of a real tokenizer (as Mistral's ``[TOOL_CALLS]`` is): the
constraint names it by id (``<[id]>``), text cannot spell it, and the reply is decoded with it.

The default model's tokenizer has no tool-call token, so ``<|im_start|>`` stands in for one (the grammar is
the same for any id). The matcher is llguidance's, on the model's real vocabulary.
"""

from __future__ import annotations

import dataclasses

import llguidance
import pytest

import pagedgen as pg
from pagedgen.guidance.spec import compile_guidance
from pagedgen.guidance.tokenizer import guidance_tokenizer
from pagedgen.server.auto_tools import special_token_id
from pagedgen.server.tool_parsers import FORMATS, ToolCallParser, tool_call_grammar

pytestmark = pytest.mark.model

PING = [("ping", {"type": "object", "properties": {}, "additionalProperties": False})]


def test_a_special_token_trigger_opens_a_constrained_call(default_model):
    tokenizer = pg.Tokenizer(default_model)
    trigger = special_token_id(tokenizer, "<|im_start|>")
    assert trigger == 1 and special_token_id(tokenizer, "<tool_call>") is None  # text there, not a token
    grammar = compile_guidance(
        "lark_grammar", tool_call_grammar(FORMATS["mistral"], PING, True, trigger)
    ).grammar
    assert f"<[{trigger}]>" in grammar

    def run(text_before: str, call: str) -> tuple[llguidance.LLMatcher, list[int], list[int]]:
        matcher = llguidance.LLMatcher(guidance_tokenizer(default_model), grammar, log_level=0)
        ids = tokenizer.encode(text_before, parse_special=False) + [trigger]
        ids += tokenizer.encode(call, parse_special=False)
        consumed = []
        for token in ids:
            if not matcher.consume_token(token):
                break
            consumed.append(token)
        return matcher, consumed, ids

    matcher, consumed, ids = run("Let me check.", ' [{"name": "ping", "arguments": {}}]')
    assert consumed == ids and matcher.is_stopped()  # the call is whole: only EOS may follow
    text = tokenizer.decode(consumed, skip_special_tokens=False)  # how the server decodes such a reply
    parser = ToolCallParser(dataclasses.replace(FORMATS["mistral"], trigger="<|im_start|>"))
    parser.feed(text)
    parser.finish()
    assert parser.content == "Let me check." and [(c.name, c.arguments) for c in parser.calls] == [
        ("ping", "{}")
    ]
    _matcher, consumed, ids = run("Hi", ' [{"name": "pong"}]')  # not a tool: refused inside the call
    assert len(tokenizer.encode("Hi", parse_special=False)) + 1 < len(consumed) < len(ids)
