"""The tool-call parsers (hermes, llama3_json, mistral): whole text and the same text streamed in pieces.

Every case is parsed whole and in pieces of every size from 1 to 8 characters, and at random cut points:
the content, the calls and their arguments must be the same, and the stream's deltas must add up to them
(each call's first delta carrying its id and name, the arguments text exactly as written).
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedgen.server.tool_parsers import FORMATS, ToolCallParser, detect_format
from pagedgen.server.tool_parsers.json_scan import JsonValueEnd

WEATHER = '{"city": "Paris \\"centre\\" {x}", "days": [1, 2]}'
HERMES_TWO = (
    "Let me look.\n<tool_call>\n"
    f'{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n<tool_call>\n'
    '{"name": "ping", "arguments": {}}\n</tool_call>\n'
)
CASES = [
    # (format, text, content, [(name, arguments, complete)])
    ("hermes", HERMES_TWO, "Let me look.", [("get_weather", WEATHER, True), ("ping", "{}", True)]),
    ("hermes", '<tool_call>{"name":"ping","arguments":{}}</tool_call>', "", [("ping", "{}", True)]),
    ("hermes", "Text, a < sign and <tool but no call.\n", "Text, a < sign and <tool but no call.\n",
     []),
    ("hermes", "ends on a partial trigger <tool_ca", "ends on a partial trigger <tool_ca", []),
    ("hermes", '<tool_call>\n{"arguments": {"a": 1}, "name": "f"}\n</tool_call>', "",
     [("f", '{"a": 1}', True)]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": [1, {"b', "", [("f", '{"a": [1, {"b', False)]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call> and then some text', "",
     [("f", "{}", True)]),
    ("llama3_json", '{"name": "get_weather", "parameters": ' + WEATHER + '}; {"name": "ping", '
     '"parameters": {}}', "", [("get_weather", WEATHER, True), ("ping", "{}", True)]),
    ("llama3_json", '<|python_tag|>{"name": "ping", "parameters": {}}', "", [("ping", "{}", True)]),
    ("llama3_json", "The answer is {4}.", "The answer is {4}.", []),
    ("llama3_json", "", "", []),
    ("llama3_json", '{"name": "f", "parameters": {"q": "x"', "", [("f", '{"q": "x"', False)]),
    ("mistral", 'Sure [TOOL_CALLS] [{"name": "get_weather", "arguments": ' + WEATHER + '}, {"name": "ping", '
     '"arguments": {}}]', "Sure", [("get_weather", WEATHER, True), ("ping", "{}", True)]),
    ("mistral", '[TOOL_CALLS][{"name":"ping","arguments":{}}]', "", [("ping", "{}", True)]),
    ("mistral", "No [TOOL CALLS] here [1, 2]", "No [TOOL CALLS] here [1, 2]", []),
]  # fmt: skip


def parse(fmt: str, pieces: list[str]):
    parser = ToolCallParser(FORMATS[fmt])
    deltas = [parser.feed(piece) for piece in pieces]
    deltas.append(parser.finish())
    return parser, deltas


def pieces_of(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


def check(fmt: str, pieces: list[str], content: str, calls: list[tuple[str, str, bool]]) -> None:
    parser, deltas = parse(fmt, pieces)
    assert parser.content == content
    assert [(c.name, c.arguments, c.complete) for c in parser.calls] == calls
    assert "".join(d.content for d in deltas) == content
    streamed: dict[int, list] = {}
    for delta in deltas:
        for call in delta.calls:
            if call.index not in streamed:
                assert call.id is not None and call.name is not None  # the first piece names the call
                streamed[call.index] = [call.id, call.name, ""]
            else:
                assert call.id is None and call.name is None
            streamed[call.index][2] += call.arguments
    assert sorted(streamed) == list(range(len(calls)))
    for index, call in enumerate(parser.calls):
        assert streamed[index] == [call.id, call.name, call.arguments]
    assert parser.complete == (bool(calls) and all(c[2] for c in calls))


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
@pytest.mark.parametrize("size", [None, 1, 2, 3, 5, 8])
def test_whole_and_streamed_text_parse_the_same(fmt, text, content, calls, size):
    check(fmt, [text] if size is None else pieces_of(text, size), content, calls)


@given(st.sampled_from(CASES), st.lists(st.integers(0, 400), max_size=12))
def test_any_cut_points_parse_the_same(case, cuts):
    fmt, text, content, calls = case
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    check(fmt, [text[a:b] for a, b in zip(points, points[1:], strict=False)] or [""], content, calls)


def test_the_content_before_a_call_is_held_until_it_is_known():
    """Trailing whitespace and a trigger's beginning are held back: they may belong to a call."""
    parser = ToolCallParser(FORMATS["hermes"])
    assert parser.feed("Hello \n").content == "Hello"
    assert parser.feed("<tool").content == ""
    delta = parser.feed("_call>\n")
    assert delta.content == "" and not delta.calls
    delta = parser.feed('{"name": "f", "arguments": {"a"')
    assert [(c.index, c.name, c.arguments) for c in delta.calls] == [(0, "f", ""), (0, None, '{"a"')]
    text_only = ToolCallParser(FORMATS["hermes"])
    assert text_only.feed("Hello \n").content == "Hello"
    assert text_only.finish().content == " \n"  # no call came: the text is the reply, exactly


def test_a_call_streams_its_name_before_its_arguments_close():
    parser = ToolCallParser(FORMATS["mistral"])
    delta = parser.feed('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Pa')
    assert [(c.name, c.arguments) for c in delta.calls] == [("get_weather", ""), (None, '{"city": "Pa')]
    assert parser.feed('ris"}').calls[0].arguments == 'ris"}'
    assert parser.feed("}]").calls == []
    assert parser.complete


@pytest.mark.parametrize(
    ("text", "end"),
    [
        ('{"a": "}"} tail', 10),
        ('  [1, [2, "]"], {"x": "\\""}], more', 28),
        ('"a \\" b" x', 8),
        ("123, 4", 3),
        ("true}", 4),
        ('{"a": {', None),
    ],
)
def test_json_value_end_finds_where_a_value_stops(text, end):
    whole = JsonValueEnd()
    start, stop = whole.feed(text)
    assert whole.done == (end is not None)
    assert stop == (len(text) if end is None else end)
    assert start == len(text) - len(text.lstrip())
    if end is not None and text.lstrip()[0] in '{["':
        json.loads(text[start:stop])
    pieces = JsonValueEnd()  # one character at a time: the same end
    offset = 0
    for index, char in enumerate(text):
        _s, e = pieces.feed(char)
        if pieces.done:
            offset = index + e
            break
    assert pieces.done == whole.done and (not whole.done or offset == stop)


@pytest.mark.parametrize(
    ("template", "name"),
    [
        ("{% for t in tools %}{{ t | tojson }}{% endfor %}<tool_call>", "hermes"),
        ('{{ "[AVAILABLE_TOOLS]" }}{{ tools }}[TOOL_CALLS]', "mistral"),
        ("{{ tools }}<|python_tag|>", "llama3_json"),
        ('Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
         'value}', "llama3_json"),
        ("{{ tools }} <function=...>", None),
    ],
)  # fmt: skip
def test_the_format_is_detected_from_the_template(template, name):
    fmt = detect_format(template)
    assert (fmt.name if fmt else None) == name
