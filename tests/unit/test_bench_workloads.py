"""bench.workloads: W1/W2/B1/R1 are exactly their definitions, deterministic, cut from the built-in text."""

from __future__ import annotations

import pytest

from pagedgen.bench.workloads import (
    B1,
    BENCH_TEXT,
    PP512,
    R1,
    REPEAT_INSTRUCTION,
    TG128,
    W1,
    W2,
    LengthRange,
    WorkloadSpec,
    build_workload,
    repeat_prompt,
    repeat_text,
    text_tokens,
    workload_by_name,
    workload_totals,
)
from pagedgen.models.synthetic import SyntheticModel

TOKENIZER = SyntheticModel().tokenizer


def _is_window_of_text(prompt: tuple[int, ...], text: list[int]) -> bool:
    stream = text * (2 + len(prompt) // len(text))
    return any(tuple(stream[o : o + len(prompt)]) == prompt for o in range(len(text)))


def test_w1_definition():
    requests = build_workload(W1, TOKENIZER)
    assert len(requests) == 64
    assert {len(r.prompt_ids) for r in requests} == {100}
    assert {r.output_len for r in requests} == {128}
    assert [r.index for r in requests] == list(range(64))
    assert workload_totals(requests) == (6400, 8192)
    assert W1.max_batch_size is None


def test_w2_lengths_are_uniform_draws_within_the_ranges():
    requests = build_workload(W2, TOKENIZER)
    assert len(requests) == 128
    inputs = [len(r.prompt_ids) for r in requests]
    outputs = [r.output_len for r in requests]
    assert min(inputs) >= 32 and max(inputs) <= 512 and min(outputs) >= 16 and max(outputs) <= 256
    assert len(set(inputs)) > 64 and len(set(outputs)) > 64  # drawn, not constant


def test_w2_is_pinned_by_its_seed():
    """PCG64 streams are stable across numpy versions: these are W2's first requests forever."""
    requests = build_workload(W2, TOKENIZER)
    assert [(len(r.prompt_ids), r.output_len) for r in requests[:4]] == [
        (441, 232),
        (338, 87),
        (277, 233),
        (161, 177),
    ]
    assert workload_totals(requests) == (35475, 18380)


def test_building_twice_gives_identical_requests_and_another_seed_differs():
    assert build_workload(W2, TOKENIZER) == build_workload(W2, TOKENIZER)
    other = WorkloadSpec("W2", 128, W2.input_len, W2.output_len, seed=1)
    assert build_workload(other, TOKENIZER) != build_workload(W2, TOKENIZER)


def test_prompts_are_windows_of_the_builtin_text():
    text = text_tokens(TOKENIZER)
    requests = build_workload(W2, TOKENIZER)
    assert all(_is_window_of_text(r.prompt_ids, text) for r in requests[:16])
    assert len({r.prompt_ids for r in requests}) == len(requests)  # no two requests share a prompt


def test_prompt_longer_than_the_text_wraps_around():
    text = text_tokens(TOKENIZER)
    spec = WorkloadSpec("long", 3, LengthRange(len(text) + 50, len(text) + 50), LengthRange(4, 4), seed=3)
    requests = build_workload(spec, TOKENIZER)
    assert all(
        len(r.prompt_ids) == len(text) + 50 and _is_window_of_text(r.prompt_ids, text) for r in requests
    )


def test_b1_pins_batch_one():
    assert B1.max_batch_size == 1
    assert workload_totals(build_workload(B1, TOKENIZER)) == (400, 512)


def test_pp512_and_tg128_are_llama_benchs_tests_at_batch_one():
    prefills, decodes = build_workload(PP512, TOKENIZER), build_workload(TG128, TOKENIZER)
    assert PP512.max_batch_size == TG128.max_batch_size == 1
    assert [(len(r.prompt_ids), r.output_len) for r in prefills] == [(512, 1)] * 4
    assert [(len(r.prompt_ids), r.output_len) for r in decodes] == [(1, 128)] * 4
    assert workload_by_name("pp512") is PP512 and workload_by_name("tg128") is TG128


def test_lookup_and_parsing():
    assert workload_by_name("w2") is W2
    with pytest.raises(ValueError, match="unknown workload 'W9'; named workloads: W1, W2, B1"):
        workload_by_name("W9")
    assert LengthRange.parse("100") == LengthRange(100, 100)
    assert LengthRange.parse("32:512") == LengthRange(32, 512)
    assert str(LengthRange(32, 512)) == "32:512" and str(LengthRange(7, 7)) == "7"
    for bad in ("", "x", "5:2", "0", "-3:4"):
        with pytest.raises(ValueError, match="must be N or LOW:HIGH"):
            LengthRange.parse(bad)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: WorkloadSpec("", 1, LengthRange(1, 1), LengthRange(1, 1)), "name must be non-empty"),
        (
            lambda: WorkloadSpec("x", 0, LengthRange(1, 1), LengthRange(1, 1)),
            "num_requests must be a positive",
        ),
        (
            lambda: WorkloadSpec("x", 1, LengthRange(1, 1), LengthRange(1, 1), max_batch_size=0),
            "max_batch_size must be None or a positive",
        ),
        (lambda: LengthRange(3, 2), r"high \(2\) must be >= low \(3\)"),
        (lambda: LengthRange(0, 2), "low must be a positive int"),
    ],
)
def test_spec_validation(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_r1_asks_to_repeat_whole_sentences_of_the_text_at_batch_one():
    requests = build_workload(R1, TOKENIZER)
    assert len(requests) == 4 and R1.max_batch_size == 1 and {r.output_len for r in requests} == {128}
    instruction = TOKENIZER.encode(REPEAT_INSTRUCTION)
    flat = " ".join(BENCH_TEXT.split())
    for request in requests:  # the synthetic codec is one token per character
        assert list(request.prompt_ids[: len(instruction)]) == instruction
        text = TOKENIZER.decode(list(request.prompt_ids[len(instruction) :]))
        assert 0 < len(text) <= 160 and text.endswith(".") and text[0].isupper()
        assert text in flat + " " + flat  # a paragraph start, whole sentences, wrapping to the first
    assert build_workload(R1, TOKENIZER) == requests
    assert len({r.prompt_ids for r in requests}) == 4  # paragraphs 0..3
    assert "repeat <= 160 text tokens" in R1.describe()


def test_repeat_text_takes_whole_sentences_from_a_paragraph_start():
    text = repeat_text(TOKENIZER, 6, 120)  # paragraph 6 mod 6: the first
    assert text.startswith("The harbour town woke slowly") and text.endswith(".") and len(text) <= 120
    assert repeat_text(TOKENIZER, 1, 5) == ""  # not even one sentence fits


class TemplateTokenizer:
    """The synthetic codec plus a chat template: repeat prompts go through it."""

    def __init__(self):
        self.inner = TOKENIZER

    def encode(self, text):
        return self.inner.encode(text)

    def decode(self, ids):
        return self.inner.decode(ids)

    def apply_chat_template(self, messages):
        return f"<user>{messages[0]['content']}</user>"


def test_repeat_prompts_use_the_chat_template_when_there_is_one():
    prompt = repeat_prompt(TemplateTokenizer(), "Hello.")
    assert prompt == TOKENIZER.encode("<user>" + REPEAT_INSTRUCTION + "Hello.</user>")
