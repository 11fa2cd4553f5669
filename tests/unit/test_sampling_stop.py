"""Stop strings: matched across token boundaries, never emitted, held text released once disambiguated;
the text before the match that no released token carries comes back with the match."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedgen.errors import StopStringError
from pagedgen.sampling import StopStringMatcher

PIECES = ["a", "b", "c", "ab", "ba", "bc", "abc", "\n", "\n\n", "x\n", "", "cab"]


def _decode(tokens: list[int]) -> str:
    return "".join(PIECES[t] for t in tokens)


def _ids(*pieces: str) -> list[int]:
    return [PIECES.index(p) for p in pieces]


def _run(
    stops: list[str], tokens: list[int], decode=_decode
) -> tuple[list[list[int]], int | None, list[int]]:
    """Feed until a match; returns (release per feed, matched index, flushed tokens if no match)."""
    matcher = StopStringMatcher(stops, decode)
    releases = []
    for t in tokens:
        update = matcher.feed(t)
        releases.append(update.release)
        if update.matched is not None:
            assert matcher.finished and matcher.matched == update.matched and matcher.flush() == []
            return releases, update.matched, []
    return releases, None, matcher.flush()


def _cut(stops: list[str], tokens: list[int], decode=_decode) -> tuple[list[int], str, int | None]:
    """Feed until a match; returns (released tokens, text_before_match, matched index)."""
    matcher = StopStringMatcher(stops, decode)
    released: list[int] = []
    for t in tokens:
        update = matcher.feed(t)
        released += update.release
        if update.matched is not None:
            return released, update.text_before_match, update.matched
        assert update.text_before_match == ""
    return released + matcher.flush(), "", None


def test_split_across_tokens_is_matched_and_never_emitted() -> None:
    releases, matched, _ = _run(["\n\n"], _ids("ab", "\n", "\n", "c"))
    assert releases == [_ids("ab"), [], []] and matched == 0


def test_match_at_the_very_start() -> None:
    assert _run(["\n\n"], _ids("\n\n", "a")) == ([[]], 0, [])
    assert _run(["ab"], _ids("a", "b")) == ([[], []], 0, [])


def test_token_straddling_the_match_start_is_dropped_but_its_text_before_the_match_is_returned() -> None:
    """'x\\n' holds text before the stop string; emitting it would leak the stop string's first character."""
    assert _run(["\n\n"], _ids("a", "x\n", "\n")) == ([_ids("a"), [], []], 0, [])
    assert _cut(["\n\n"], _ids("a", "x\n", "\n")) == (_ids("a"), "x", 0)


def test_text_before_match_at_the_boundaries() -> None:
    # the match starts exactly where a released token ends: nothing to add
    assert _cut(["\n"], _ids("ab", "\n")) == (_ids("ab"), "", 0)
    assert _cut(["ab"], _ids("ab")) == ([], "", 0)
    # the match lies inside one token, with text before and after it
    assert _cut(["b"], _ids("c", "abc")) == (_ids("c"), "a", 0)
    # held across several tokens ("ab" straddles the start of "bcax"): its "a" comes back
    assert _cut(["bcax"], _ids("a", "ab", "c", "a", "x\n")) == (_ids("a"), "a", 0)
    # a held token that ends at the match start is released with the match
    assert _cut(["abca", "cb"], _ids("ab", "c", "b")) == (_ids("ab"), "", 1)
    # several stop strings: the earliest start decides where the text is cut
    assert _cut(["ca", "ab"], _ids("x\n", "cab")) == (_ids("x\n"), "", 0)
    assert _cut(["ca", "bc"], _ids("abc", "ab")) == ([], "a", 1)


def test_long_stop_string_held_across_short_text() -> None:
    """The kept tail must cover the whole text while it is shorter than the longest stop string."""
    assert _run(["abbaa"], _ids("cab", "b")) == ([[], []], None, _ids("cab", "b"))
    assert _run(["abbaa"], _ids("cab", "ba", "a")) == ([[], [], []], 0, [])


def test_held_token_text_longer_than_the_longest_stop_string_comes_back_whole() -> None:
    """'cab' is held because its 'b' may start 'bc': the kept text must reach back past max(len(stop)) - 1."""
    assert _cut(["bc"], _ids("x\n", "cab", "c")) == (_ids("x\n"), "ca", 0)
    assert _cut(["bc"], _ids("cab", "ab", "c")) == (_ids("cab"), "a", 0)


def test_held_prefix_is_released_once_disambiguated_or_flushed() -> None:
    releases, matched, flushed = _run(["abc"], _ids("a", "b", "a", "c"))
    # "a" held, "ab" held, "aba": only the last "a" may still start "abc", "abac": nothing can
    assert releases == [[], [], _ids("a", "b"), _ids("a", "c")] and matched is None and flushed == []
    assert _run(["abc"], _ids("c", "a", "b")) == ([_ids("c"), [], []], None, _ids("a", "b"))


def test_overlapping_candidates_earliest_start_wins_ties_go_to_the_lower_index() -> None:
    # "ab" is a prefix of "abd" (held), then "bc" completes inside it: release what precedes "bc" only
    assert _run(["abd", "bc"], _ids("a", "b", "c")) == ([[], [], _ids("a")], 1, [])
    # one token completes two stop strings: the one starting earlier in the text wins
    assert _run(["ab", "bca"], _ids("b", "cab"))[1] == 1
    assert _run(["ab", "ca"], _ids("cab"))[1] == 1
    # same start: the lower index wins
    assert _run(["abc", "ab"], _ids("abc"))[1] == 0
    assert _run(["ab", "abc"], _ids("abc"))[1] == 0
    # self-overlapping stop string: "aab" inside "aaab"
    assert _run(["aab"], _ids("a", "a", "a", "b")) == ([[], [], _ids("a"), []], 0, [])


def _oracle(stops: list[str], tokens: list[int]) -> tuple[list[int], int | None, list[int]]:
    """Brute force on the full text: (cumulative release after each feed, matched index, all released)."""
    ends, text, cumulative = [], "", []
    for k, t in enumerate(tokens):
        text += PIECES[t]
        ends.append(len(text))
        hits = [(text.find(s), i) for i, s in enumerate(stops) if s in text]
        if hits:
            pos, index = min(hits)
            released = [tok for tok, end in zip(tokens[: k + 1], ends, strict=True) if end <= pos]
            return cumulative + [len(released)], index, released
        partial = max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        n_free = 0
        while n_free < len(ends) and ends[n_free] <= len(text) - partial:
            n_free += 1
        cumulative.append(n_free)
    return cumulative, None, list(tokens)


@given(
    stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=6), min_size=1, max_size=3),
    tokens=st.lists(st.integers(0, len(PIECES) - 1), max_size=16),
)
def test_matches_a_brute_force_oracle(stops: list[str], tokens: list[int]) -> None:
    releases, matched, flushed = _run(stops, tokens)
    cumulative, oracle_matched, oracle_released = _oracle(stops, tokens)
    assert matched == oracle_matched
    assert [sum(len(r) for r in releases[: k + 1]) for k in range(len(releases))] == cumulative
    released = [t for r in releases for t in r] + flushed
    assert released == oracle_released
    if matched is not None:
        assert stops[matched] not in _decode(released)  # the stop string is never emitted
        text = _decode(tokens[: len(releases)])  # the text when the match was found
        cut = min(text.find(s) for s in stops if s in text)
        released, before, _ = _cut(stops, tokens)
        assert _decode(released) + before == text[:cut]


# ------------------------------------------------------------------------------------------- multi-byte

BYTES = [b"x", b"\xc3", b"\xa9", b"!", b"\xf0\x9f", b"\x98", b"\x80", "é".encode()]


def _decode_bytes(tokens: list[int]) -> str:
    return b"".join(BYTES[t] for t in tokens).decode("utf-8", errors="replace")


def test_partial_utf8_is_not_text_yet() -> None:
    # "é" split in two tokens; stop "é!": x is free, the halves are held, "!" completes the stop string
    assert _run(["é!"], [0, 1, 2, 3], _decode_bytes) == ([[0], [], [], []], 0, [])
    # the stop string U+FFFD never matches the replacement character of an incomplete sequence
    assert _run(["\ufffd"], [1, 2, 0], _decode_bytes) == ([[], [1, 2], [0]], None, [])
    # a 4-byte emoji in three tokens, stop string "😀": matched, nothing emitted
    assert _run(["😀"], [4, 5, 6], _decode_bytes) == ([[], [], []], 0, [])
    # the turn ends inside a character: flush releases the pending bytes
    assert _run(["zz"], [0, 4, 5], _decode_bytes) == ([[0], [], []], None, [4, 5])
    assert _run(["é"], [7], _decode_bytes) == ([[]], 0, [])


def test_sentencepiece_style_leading_space_uses_decode_context() -> None:
    """decode() drops the leading space of a sequence; the incremental window keeps the inner spaces."""
    words = ["▁Hello", "▁world", "!"]

    def decode(tokens: list[int]) -> str:
        return "".join(words[t] for t in tokens).replace("▁", " ").removeprefix(" ")

    assert _run([" world"], [0, 1, 2], decode) == ([[0], []], 0, [])
    assert _run(["Hello"], [0], decode) == ([[]], 0, [])


def test_each_feed_decodes_a_short_window_only() -> None:
    seen: list[int] = []

    def decode(tokens: list[int]) -> str:
        seen.append(len(tokens))
        return _decode(tokens)

    matcher = StopStringMatcher(["zzz"], decode)
    released = [t for _ in range(300) for t in matcher.feed(PIECES.index("ab")).release]
    assert len(released) == 300 and max(seen) <= 2


def test_checkpoint_restore_replays_exactly() -> None:
    matcher = StopStringMatcher(["abc", "\n\n"], _decode)
    assert matcher.feed(PIECES.index("x\n")).release == []
    cp = matcher.checkpoint()
    assert matcher.feed(PIECES.index("\n")).matched == 1  # an injected failure rolls this step back
    matcher.restore(cp)
    assert not matcher.finished and matcher.held == _ids("x\n")
    assert matcher.feed(PIECES.index("ab")).release == _ids("x\n")
    cp2 = matcher.checkpoint()
    assert matcher.feed(PIECES.index("c")).matched == 0
    matcher.restore(cp2)
    update = matcher.feed(PIECES.index("c"))
    assert (update.release, update.matched) == ([], 0)
    matcher.restore(cp2)
    assert matcher.flush() == _ids("ab")
    other = StopStringMatcher(["abc"], _decode)
    with pytest.raises(StopStringError):
        matcher.restore(other.checkpoint())
    assert matcher.finished  # refused restore changed nothing


def test_no_stop_strings_releases_everything_without_decoding() -> None:
    def decode(tokens: list[int]) -> str:
        raise AssertionError("decode must not be called")

    matcher = StopStringMatcher([], decode)
    assert [matcher.feed(t).release for t in (5, 6)] == [[5], [6]] and matcher.flush() == []


@pytest.mark.parametrize("stops", [[""], "abc", ["ok", 3]])
def test_bad_stop_strings_are_refused(stops) -> None:
    with pytest.raises(StopStringError):
        StopStringMatcher(stops, _decode)


def test_feed_after_finish_is_refused() -> None:
    matcher = StopStringMatcher(["a"], _decode)
    assert matcher.feed(PIECES.index("a")).matched == 0
    with pytest.raises(StopStringError):
        matcher.feed(0)
    flushed = StopStringMatcher(["a"], _decode)
    flushed.flush()
    with pytest.raises(StopStringError):
        flushed.feed(0)


def _oracle_bytes(stops: list[str], tokens: list[int]) -> tuple[int | None, list[int]]:
    """Brute force over byte tokens: text is the full decode whenever it does not end inside a character."""
    ends: list[int | None] = []
    for k in range(len(tokens)):
        ends.append(None)
        text = _decode_bytes(tokens[: k + 1])
        if text.endswith("\ufffd"):
            continue
        ends = [len(text) if e is None else e for e in ends]
        hits = [(text.find(s), i) for i, s in enumerate(stops) if s in text]
        if hits:
            pos, index = min(hits)
            return index, [t for t, e in zip(tokens, ends, strict=False) if e is not None and e <= pos]
    return None, list(tokens)


@given(
    stops=st.lists(st.sampled_from(["é", "x!", "é!", "\ufffd", "😀", "!x", "xé"]), min_size=1, max_size=2),
    tokens=st.lists(st.integers(0, len(BYTES) - 1), max_size=12),
)
def test_byte_tokens_match_a_brute_force_oracle(stops: list[str], tokens: list[int]) -> None:
    releases, matched, flushed = _run(stops, tokens, _decode_bytes)
    released = [t for r in releases for t in r] + flushed
    assert (matched, released) == _oracle_bytes(stops, tokens)
    released, before, _ = _cut(stops, tokens, _decode_bytes)
    if matched is not None:
        texts = [_decode_bytes(tokens[:k]) for k in range(len(tokens) + 1)]
        text = next(t for t in texts if any(s in t and not t.endswith("\ufffd") for s in stops))
        assert _decode_bytes(released) + before == text[: min(text.find(s) for s in stops if s in text)]


def test_text_before_match_completes_a_character_split_across_tokens() -> None:
    """'x' + the first byte of 'é' is pending; the next token completes 'é' and holds the stop string."""
    pieces = [b"x\xc3", b"\xa9!", b"ab", b"\xc3", b"\xa9", b"!"]

    def decode(tokens: list[int]) -> str:
        return b"".join(pieces[t] for t in tokens).decode("utf-8", errors="replace")

    assert _cut(["!"], [2, 0, 1], decode) == ([2], "xé", 0)
    assert _cut(["!"], [3, 1], decode) == ([], "é", 0)
    assert _cut(["é!"], [2, 3, 1], decode) == ([2], "", 0)
    # released tokens end on a whole character: a detokenizer of them holds nothing back
    assert _cut(["!"], [2, 3, 4, 5], decode) == ([2, 3, 4], "", 0)
    assert _cut(["!"], [2, 0, 4, 5], decode) == ([2, 0, 4], "", 0)
