"""The engine's llguidance parts without an engine: tokenizer view, cursor, batched masks, bitmask apply.

Every mask is compared with llguidance's own single-matcher ``compute_bitmask`` (the oracle), and the apply
with an explicit per-token loop.
"""

from __future__ import annotations

import os

import llguidance
import numpy as np
import pytest
import torch

from pagedgen.errors import GuidanceError
from pagedgen.guidance import compile_guidance
from pagedgen.guidance.bitmask import TokenMasks, apply_token_bitmask_, bitmask_words
from pagedgen.guidance.cursor import GrammarCursor, compiled_matcher
from pagedgen.guidance.masks import MaskComputer, MaskRow, available_cpus
from pagedgen.guidance.tokenizer import guidance_tokenizer
from pagedgen.models.synthetic import SyntheticModel
from pagedgen.sampling import RequestSampler, SamplingOptions
from pagedgen.sampling.sampler import SampleRow, process_logits

V = 257
EOS = 256
EMAIL = compile_guidance("regex", r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)")
DIGITS = compile_guidance("regex", r"[0-9]{4}")


def tok(text: str) -> list[int]:
    """Synthetic ids of ``text`` (token t is chr(32 + t))."""
    return [ord(c) - 32 for c in text]


def spelling(chars: str) -> list[int]:
    """Every synthetic id that spells one of ``chars`` (t and t + 95 spell the same; EOS spells nothing)."""
    return [t for t in range(V) if t != EOS and chr(32 + t % 95) in chars]


def bits(mask: bytes | torch.Tensor, vocab: int = V) -> list[int]:
    """The allowed token ids of one mask row."""
    raw = mask if isinstance(mask, bytes) else mask.numpy().tobytes()
    return np.nonzero(np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")[:vocab])[
        0
    ].tolist()


@pytest.fixture(scope="module")
def model() -> SyntheticModel:
    return SyntheticModel(vocab_size=V, eos_token_id=EOS)


def cursor(model, spec=EMAIL, text: str = "") -> GrammarCursor:
    c = GrammarCursor.for_model(model, spec)
    for t in tok(text):
        c.consume(t)
    return c


# -- tokenizer view -------------------------------------------------------------------------------------


def test_the_synthetic_tokenizer_view_spells_tokens_as_the_model_does(model):
    view = guidance_tokenizer(model)
    assert view.vocab_size == V and view.eos_token == EOS and view.eos_tokens == [EOS]
    assert view.decode_str([33, 34, 128]) == "AB" + chr(32 + 128 % 95)
    assert view.is_special_token(EOS) and not view.is_special_token(33)
    assert guidance_tokenizer(model) is view  # built once per model
    assert guidance_tokenizer(SyntheticModel(vocab_size=V, eos_token_id=EOS)) is not view


def test_json_schemas_use_the_json_sliced_view_with_the_same_masks(model):
    general, sliced = guidance_tokenizer(model), guidance_tokenizer(model, json=True)
    assert sliced is not general and guidance_tokenizer(model, json=True) is sliced
    assert sliced.vocab_size == general.vocab_size and sliced.eos_tokens == general.eos_tokens
    spec = compile_guidance("json_schema", {"type": "object", "properties": {"a": {"type": "string"}}})
    fast, plain = (
        GrammarCursor.for_model(model, spec),
        GrammarCursor(spec, compiled_matcher(general, spec.grammar).deep_copy(), general.vocab_size),
    )
    for t in tok('{"a": "x y'):
        assert fast.allowed_bitmask() == plain.allowed_bitmask()
        fast.consume(t)
        plain.consume(t)


def test_a_model_without_eos_gets_llguidance_s_virtual_eos_past_the_logits():
    view = guidance_tokenizer(SyntheticModel(vocab_size=V))
    assert view.vocab_size == V + 1 and view.eos_token == V


# -- cursor ---------------------------------------------------------------------------------------------


def test_compiled_matchers_are_cached_and_cursors_are_independent(model):
    view = guidance_tokenizer(model)
    assert compiled_matcher(view, EMAIL.grammar) is compiled_matcher(view, EMAIL.grammar)
    a, b = cursor(model), cursor(model)
    a.consume(tok("a")[0])
    assert a.num_consumed == 1 and b.num_consumed == 0
    letters = spelling("abcdefghijklmnopqrstuvwxyz")
    assert bits(b.allowed_bitmask()) == letters
    assert bits(compiled_matcher(view, EMAIL.grammar).compute_bitmask()) == letters  # never advanced


def test_a_grammar_that_fails_for_the_tokenizer_is_refused(model):
    with pytest.raises(GuidanceError, match="tokenizer.*999"):
        GrammarCursor.for_model(model, compile_guidance("lark_grammar", "start: <[999]>"))


def test_restore_returns_exactly_to_the_checkpoint(model):
    c = cursor(model, text="abc")
    saved = c.checkpoint()
    before = (c.num_consumed, c.allowed_bitmask(), c.complete)
    for t in tok("@xy.com"):
        c.consume(t)
    assert c.complete and bits(c.allowed_bitmask()) == [EOS]  # complete: only EOS
    c.restore(saved)
    assert (c.num_consumed, c.allowed_bitmask(), c.complete) == before
    for t in tok("d@xy.org"):  # and it goes on from there
        c.consume(t)
    assert c.complete and c.num_consumed == 11


def test_a_rejected_token_poisons_the_cursor_for_good(model):
    c = cursor(model, text="ab")
    saved = c.checkpoint()
    with pytest.raises(GuidanceError, match="doesn't satisfy the grammar"):
        c.consume(tok("1")[0])
    assert c.error is not None and "fails parse" in c.error and not c.complete
    c.restore(saved)  # restoring the matcher does not un-poison the cursor
    with pytest.raises(GuidanceError):
        c.consume(tok("c")[0])
    with pytest.raises(GuidanceError):
        c.matcher  # noqa: B018 - the property raises


# -- batched masks --------------------------------------------------------------------------------------


def test_batched_masks_equal_llguidance_s_own_per_matcher_masks(model):
    cursors = [
        cursor(model),
        cursor(model, text="abc"),
        cursor(model, text="abc@de."),
        cursor(model, DIGITS, "12"),
    ]
    rows = [MaskRow(10 + i, c, row=2 * i) for i, c in enumerate(cursors)]
    result = MaskComputer(num_threads=2).compute(rows)
    assert result.failed == [] and result.masks.rows.tolist() == [0, 2, 4, 6]
    assert result.masks.bitmask.shape == (4, bitmask_words(V))
    for c, mask in zip(cursors, result.masks.bitmask, strict=True):
        assert mask.numpy().tobytes() == c.allowed_bitmask()
    assert [c.num_consumed for c in cursors] == [0, 3, 7, 2]  # computing masks never advances a cursor


def test_draft_rows_get_the_masks_after_their_drafts_and_pass_through_after_a_rejected_one(model):
    c = cursor(model, text="ab")
    drafts = tuple(tok("c@d1ef"))  # "1" is rejected: rows after it are never used
    computer = MaskComputer(num_threads=2)
    result = computer.compute([MaskRow(7, c, row=3, drafts=drafts)])
    masks = result.masks
    assert masks.rows.tolist() == list(range(3, 3 + len(drafts) + 1))
    for i in range(4):  # rows 0..3: after "", "c", "c@", "c@d" (the last decides the rejected "1")
        expected = cursor(model, text="ab" + "c@d"[:i]).allowed_bitmask()
        assert masks.bitmask[i].numpy().tobytes() == expected
    assert (masks.bitmask[4:] == -1).all()  # pass-through: every token allowed
    assert c.num_consumed == 2 and c.allowed_bitmask() == cursor(model, text="ab").allowed_bitmask()
    assert computer.stats.rows_masked == len(drafts) + 1 and computer.stats.mask_seconds > 0


def test_rows_with_and_without_drafts_mix_in_one_batch(model):
    plain, drafted = cursor(model, text="ab"), cursor(model, DIGITS, "1")
    result = MaskComputer(num_threads=2).compute(
        [MaskRow(1, plain, row=0), MaskRow(2, drafted, row=1, drafts=tuple(tok("23")))]
    )
    masks = result.masks.bitmask
    assert result.failed == [] and result.masks.rows.tolist() == [0, 1, 2, 3]
    assert masks[0].numpy().tobytes() == plain.allowed_bitmask()
    for i, text in enumerate(("1", "12", "123")):
        assert masks[1 + i].numpy().tobytes() == cursor(model, DIGITS, text).allowed_bitmask()


def test_a_poisoned_cursor_is_reported_and_the_others_still_get_masks(model):
    bad, good = cursor(model, text="ab"), cursor(model, text="ab")
    with pytest.raises(GuidanceError):
        bad.consume(tok("9")[0])
    behind = cursor(model, text="ab")
    behind._matcher.consume_token(0)  # an error llguidance reports only through the matcher
    result = MaskComputer(num_threads=1).compute(
        [MaskRow(1, bad, 0), MaskRow(2, good, 1), MaskRow(3, behind, 2)]
    )
    assert [rid for rid, _ in result.failed] == [1, 3]
    assert behind.error is not None  # now poisoned for good
    assert result.masks.bitmask[1].numpy().tobytes() == good.allowed_bitmask()


def test_submit_runs_on_the_worker_and_joins(model):
    computer = MaskComputer()
    pending = computer.submit([MaskRow(1, cursor(model), 0)])
    assert pending.result() is pending.result()  # joined once
    assert computer.stats.rows_masked == 1 and computer.stats.wait_seconds >= 0
    computer.close()


def test_the_executor_uses_the_cpus_this_process_may_run_on():
    assert available_cpus() == len(os.sched_getaffinity(0))
    assert MaskComputer().num_threads == available_cpus()


# -- apply --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [[3, 1], [0, 1, 2, 3, 4]], ids=["some-rows", "every-row"])
@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 257])
def test_apply_masks_exactly_the_cleared_bits_of_the_named_rows(vocab, rows):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen)
    shape = (len(rows), bitmask_words(vocab))
    bitmask = torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, generator=gen)
    out = logits.clone()
    apply_token_bitmask_(out, TokenMasks(torch.tensor(rows), bitmask))
    expected = logits.clone()
    for mask_row, row in enumerate(rows):
        for t in range(vocab):
            if not (int(bitmask[mask_row, t // 32]) >> (t % 32)) & 1:
                expected[row, t] = -float("inf")
    assert torch.equal(out, expected)


def test_tokens_past_the_bitmask_are_masked():
    logits = torch.zeros(2, 40)
    apply_token_bitmask_(logits, TokenMasks(torch.tensor([1]), torch.full((1, 1), -1, dtype=torch.int32)))
    assert (logits[0] == 0).all() and (logits[1, :32] == 0).all() and torch.isinf(logits[1, 32:]).all()


def test_allowed_logits_keep_their_exact_bits_signed_zeros_included():
    logits = torch.tensor([[-0.0, 0.0, 1e-38, -3.5, float("-inf"), 7.0]])
    out = logits.clone()
    apply_token_bitmask_(out, TokenMasks(torch.tensor([0]), torch.tensor([[0b011111]], dtype=torch.int32)))
    assert torch.equal(out[0, :5].view(torch.int32), logits[0, :5].view(torch.int32))
    assert out[0, 5] == -float("inf")


def test_the_mask_is_applied_before_every_other_processor(monkeypatch):
    calls: list[str] = []
    import pagedgen.sampling.sampler as sampler

    for name in (
        "apply_token_bitmask_",
        "suppress_tokens_",
        "apply_repetition_penalty_",
        "apply_logit_bias_",
    ):
        real = getattr(sampler, name)
        monkeypatch.setattr(sampler, name, lambda *a, _n=name, _f=real: (calls.append(_n), _f(*a))[1])
    options = SamplingOptions(repetition_penalty=1.3, min_length=10, logit_bias=((4, 2.0),))
    row = SampleRow(RequestSampler(options), [1, 2, 3], 3, [], 0, (EOS,))
    allow_four = torch.zeros(1, bitmask_words(V), dtype=torch.int32)
    allow_four[0, 0] = 1 << 4
    out = process_logits(torch.zeros(1, V), [row], TokenMasks(torch.tensor([0]), allow_four))
    assert calls == [
        "apply_token_bitmask_",
        "suppress_tokens_",
        "apply_repetition_penalty_",
        "apply_logit_bias_",
    ]
    assert out[0, 4] == 2.0 and torch.isinf(out[0, :4]).all() and torch.isinf(out[0, 5:]).all()


def test_llguidance_is_the_installed_version_these_tests_describe():
    assert llguidance.LLMatcher is not None and hasattr(
        llguidance.LLExecutor, "unsafe_compute_mask_ptr_with_draft_token"
    )
