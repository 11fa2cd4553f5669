"""``pg.LLM`` and ``pg.SamplingParams`` on the synthetic model, whose greedy output is a closed formula."""

from __future__ import annotations

import pytest

import pagedgen as pg
from pagedgen.models.synthetic import SyntheticModel, SyntheticTokenizer, synthetic_greedy
from pagedgen.sampling.options import SamplingOptions

VOCAB = 95


class ModelFailure(Exception):
    """An error type the engine does not know: a fatal execution failure."""


class FailingModel(SyntheticModel):
    def forward(self, inputs, kv_cache):
        raise ModelFailure("boom")


def make_llm(num_blocks: int = 64, **model_kwargs) -> pg.LLM:
    model = SyntheticModel(vocab_size=VOCAB, **model_kwargs)
    return pg.LLM(model, pg.EngineConfig(max_batch_size=8, num_blocks=num_blocks, debug_invariants=True))


def greedy(max_tokens: int | None, **kwargs) -> pg.SamplingParams:
    return pg.SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)


def assert_all_blocks_free(llm: pg.LLM) -> None:
    stats = llm.engine.stats()
    assert stats.free_blocks == stats.total_blocks
    assert stats.resident_requests == stats.queued_requests == 0


def test_generate_token_prompts_equal_the_closed_formula():
    llm = make_llm()
    prompts = [[1, 2, 3], [40, 2, 9, 11], [7], [3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3]]
    outputs = llm.generate(prompts, greedy(6), use_tqdm=False)
    tokenizer = SyntheticTokenizer(VOCAB)
    assert [o.index for o in outputs] == [0, 1, 2, 3]
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.prompt is None
        assert out.prompt_token_ids == prompt
        assert out.token_ids == synthetic_greedy(prompt, 6, VOCAB)
        assert out.text == tokenizer.decode(out.token_ids)
        assert out.finish_reason == "length"
        assert out.stop_reason is None and out.logprobs is None
    assert_all_blocks_free(llm)


def test_single_token_id_prompt_and_text_prompts():
    llm = make_llm()
    [single] = llm.generate([4, 5, 6], greedy(3), use_tqdm=False)
    assert single.token_ids == synthetic_greedy([4, 5, 6], 3, VOCAB)
    texts = llm.generate(["hello", "abc"], greedy(4), use_tqdm=False)
    for text, out in zip(["hello", "abc"], texts, strict=True):
        ids = SyntheticTokenizer(VOCAB).encode(text)
        assert out.prompt == text and out.prompt_token_ids == ids
        assert out.token_ids == synthetic_greedy(ids, 4, VOCAB)


def test_per_prompt_sampling_params():
    llm = make_llm()
    outputs = llm.generate([[1, 2], [1, 2]], [greedy(2), greedy(5)], use_tqdm=False)
    assert [len(o.token_ids) for o in outputs] == [2, 5]
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate([[1], [2], [3]], [greedy(2), greedy(2)], use_tqdm=False)


def test_eos_finishes_with_stop_unless_ignore_eos():
    prompt = [10, 20, 30]
    free_run = synthetic_greedy(prompt, 10, VOCAB)
    eos = free_run[3]
    assert eos not in free_run[:3]
    llm = make_llm(eos_token_id=eos)
    [stopped] = llm.generate([prompt], greedy(10), use_tqdm=False)
    assert stopped.token_ids == free_run[:3]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    [ignored] = llm.generate([prompt], greedy(10, ignore_eos=True), use_tqdm=False)
    assert ignored.token_ids == free_run
    assert ignored.finish_reason == "length"


def test_stop_string_is_not_returned():
    prompt = [5, 6, 7]
    tokenizer = SyntheticTokenizer(VOCAB)
    text = tokenizer.decode(synthetic_greedy(prompt, 12, VOCAB))
    stop = text[4:6]  # synthetic tokens are one character each
    assert stop not in text[:5]
    llm = make_llm()
    [out] = llm.generate([prompt], greedy(12, stop=("never-there", stop)), use_tqdm=False)
    assert out.text == text[:4]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert_all_blocks_free(llm)


def test_logprobs_top_n_and_zero():
    llm = make_llm()
    [two, zero] = llm.generate(
        [[1, 2, 3], [1, 2, 3]], [greedy(4, logprobs=2), greedy(4, logprobs=0)], use_tqdm=False
    )
    assert [e.token_id for e in two.logprobs] == two.token_ids
    for entry in two.logprobs:
        assert len(entry.top) == 2
        assert entry.top[0][0] == entry.token_id  # greedy picks the most likely token
        assert entry.top[0][1] == pytest.approx(entry.logprob)
        assert entry.top[1][1] < entry.logprob <= 0
    assert [len(e.top) for e in zero.logprobs] == [0, 0, 0, 0]
    assert [e.logprob for e in zero.logprobs] == pytest.approx([e.logprob for e in two.logprobs])


def test_seeded_sampling_is_reproducible():
    llm = make_llm()
    params = pg.SamplingParams(max_tokens=16, temperature=1.5, seed=11)
    first = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].token_ids
    second = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].token_ids
    assert first == second
    assert first != synthetic_greedy([1, 2, 3], 16, VOCAB)  # temperature 1.5 leaves the greedy path


def test_prompt_longer_than_the_context_is_refused_before_anything_is_submitted():
    llm = make_llm(max_context=32)
    with pytest.raises(ValueError, match=r"maximum context length is 32 tokens.*requested 34 tokens"):
        llm.generate([[1, 2], [1] * 30], greedy(4), use_tqdm=False)
    assert llm.engine.stats().steps == 0
    assert_all_blocks_free(llm)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], greedy(4), use_tqdm=False)


def test_unserviceable_prompt_fails_alone():
    llm = make_llm(num_blocks=2)  # 32 tokens of cache in all
    outputs = llm.generate([[1] * 40, [1, 2, 3]], greedy(4), use_tqdm=False)
    assert outputs[0].finish_reason == "failed"
    assert outputs[1].token_ids == synthetic_greedy([1, 2, 3], 4, VOCAB)
    assert_all_blocks_free(llm)


def test_engine_failure_raises_and_closes_every_request():
    llm = pg.LLM(FailingModel(vocab_size=VOCAB), pg.EngineConfig(num_blocks=16))
    with pytest.raises(pg.EngineError, match="engine failed"):
        llm.generate([[1, 2], [3, 4]], greedy(4), use_tqdm=False)
    assert llm.engine.stats().free_blocks == llm.engine.stats().total_blocks


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_k", -1),
        ("min_p", 1.5),
        ("seed", 1.5),
        ("stop", ("",)),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("ignore_eos", 1),
        ("min_tokens", -1),
        ("logprobs", 21),
        ("logit_bias", {-1: 1.0}),
    ],
)
def test_sampling_params_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        pg.SamplingParams(**{field: value})


def test_sampling_options_are_what_the_engine_runs():
    """A greedy request's filters stay neutral (greedy decoding ignores them); the rest pass as given."""
    assert greedy(4, top_k=5, top_p=0.5, min_p=0.2).sampling_options() == SamplingOptions(do_sample=False)
    params = pg.SamplingParams(
        temperature=0.7,
        top_k=5,
        top_p=0.9,
        min_p=0.1,
        seed=3,
        presence_penalty=0.5,
        logit_bias={7: -2.0, 3: 1.0},
    )
    assert params.sampling_options() == SamplingOptions(
        do_sample=True,
        temperature=0.7,
        top_k=5,
        top_p=0.9,
        min_p=0.1,
        seed=3,
        presence_penalty=0.5,
        logit_bias=((3, 1.0), (7, -2.0)),
    )
    assert greedy(4, ignore_eos=True, min_tokens=2, seed=9).sampling_options() == SamplingOptions(
        do_sample=False, ignore_eos=True, min_new_tokens=2, seed=9
    )
    assert pg.SamplingParams(stop="x").stop == ("x",)


def test_generator_params_take_sampling_params_as_set_search_options_would():
    """The typed path and the by-name shim end in the same options."""
    model = SyntheticModel(vocab_size=16)
    params = pg.SamplingParams(temperature=0.5, top_k=3, seed=1, logit_bias={2: 1.0}, min_tokens=1)
    typed = pg.GeneratorParams(model, params)
    by_name = pg.GeneratorParams(model)
    by_name.set_search_options(
        do_sample=True, temperature=0.5, top_k=3, seed=1, logit_bias={2: 1.0}, min_new_tokens=1
    )
    assert typed.sampling == by_name.sampling == params.sampling_options()
    assert typed.max_length == by_name.max_length == model.max_context and typed.guidance is None


def test_generator_params_refuse_sampling_params_the_model_cannot_follow_and_keep_theirs():
    model = SyntheticModel(vocab_size=16)
    request_params = pg.GeneratorParams(model, pg.SamplingParams(seed=4))
    with pytest.raises(pg.EngineError, match="outside the model's vocabulary") as info:
        request_params.set_sampling_params(pg.SamplingParams(logit_bias={16: 1.0}))
    assert info.value.field == "logit_bias"
    assert (
        request_params.sampling == SamplingOptions(do_sample=True, seed=4) and request_params.guidance is None
    )


class CountingTokenizer(SyntheticTokenizer):
    """The synthetic codec (one character per token, so ``max_token_chars`` 1) with a chat template,
    counting the texts it is asked to render or encode."""

    def __init__(self, vocab_size: int):
        super().__init__(vocab_size)
        self.calls = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.calls += 1
        return super().encode(text, add_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt=True, **_variables) -> str:
        self.calls += 1
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


@pytest.mark.parametrize(
    ("chars", "max_tokens", "refused"),
    [(90 * 4, 10, False), (90 * 4 + 1, 10, True), (0, 100, True), (0, 99, False)],
)
def test_check_text_fits_bounds_characters_by_the_longest_token(chars, max_tokens, refused):
    from pagedgen.llm import check_text_fits

    problem = check_text_fits(chars, max_tokens, 100, 4)
    assert (problem is not None) is refused
    if refused:
        assert "maximum context length is 100 tokens" in problem
    assert check_text_fits(10**9, 10, 100, None) is None  # no bound: only the tokenized count can tell


def test_a_text_that_cannot_fit_is_refused_before_it_is_rendered_or_encoded():
    tokenizer = CountingTokenizer(VOCAB)
    model = SyntheticModel(vocab_size=VOCAB, max_context=64)
    llm = pg.LLM(model, pg.EngineConfig(max_batch_size=2, num_blocks=16), tokenizer=tokenizer)
    with pytest.raises(ValueError, match="prompt 1: .*holds 70 characters"):
        llm.generate(["ok", "x" * 70], greedy(4), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 0: .*holds 61 characters"):
        llm.chat([{"role": "user", "content": "x" * 61}], greedy(4), use_tqdm=False)
    assert tokenizer.calls == 0
    assert (
        llm.chat([{"role": "user", "content": "hi"}], greedy(2), use_tqdm=False)[0].finish_reason == "length"
    )
    assert_all_blocks_free(llm)


def test_a_chat_session_refuses_a_message_that_cannot_fit_before_rendering_it():
    tokenizer = CountingTokenizer(VOCAB)
    llm = pg.LLM(
        SyntheticModel(vocab_size=VOCAB, max_context=64), pg.EngineConfig(num_blocks=16), tokenizer=tokenizer
    )
    session = llm.start_chat(greedy(2))
    with pytest.raises(ValueError, match="holds 64 characters"):
        list(session.send("x" * 64))
    assert tokenizer.calls == 0
    assert "".join(session.send("hi")) == session.last.text and session.last.generated_tokens == 2
    session.close()
    assert_all_blocks_free(llm)
