"""Gemma 2 and Gemma 3 text (local and global layers, sandwich norms, soft-capping) against transformers.

Tiny random-weight checkpoints written by transformers (tests.model.tiny_checkpoints): four layers, local
(window 8), global, local, local; a query scale other than the head size; Gemma 2 soft-caps its attention
scores at 1 and both soft-cap the logits at 5; Gemma 3 rotates its local layers with base 1000 and its global
layers with linear scaling. Sequences of 40-120 tokens cross the window many times. fp32 logits within 1e-4
at every position on every path (one prefill, chunked prefill through rings, one token per step, prefill
then decode over block tables, several sequences in one step); through the engine, greedy tokens equal
transformers' while the local layers' blocks stay flat (the checks every family runs through the engine
are in test_family_conformance.py). GGUF files written the
way llama.cpp's converter writes them load and give the same logits.
"""

from __future__ import annotations

import pytest
import torch

import pagedgen as pg
from pagedgen.errors import ModelLoadError
from pagedgen.models.gguf_reader import gguf_config, open_gguf
from tests.model.family_cases import LOGITS_INIT, FamilyCase
from tests.model.hf_cases import (
    check_greedy_with_flat_window,
    ids_of,
)
from tests.model.paged_runner import (
    PagedRunner,
    PagedSequence,
    chunked_logits,
    prompt_logits,
    stepwise_logits,
)
from tests.model.tiny_checkpoints import tiny_hf_model, write_gemma_gguf

pytestmark = pytest.mark.model

TOL = 1e-4
FAMILIES = ["gemma2", "gemma3"]
LOCAL = (0, 2, 3)  # the sliding-window layers of the tiny configs
WINDOW = 8


@pytest.fixture(scope="module", params=FAMILIES)
def case(request, tmp_path_factory) -> FamilyCase:
    """Engine tests: the head untied, so greedy continuations do not collapse into a repeat (with a tied
    head the scaled embedding of the last token dominates at this size)."""
    return FamilyCase(request.param, tmp_path_factory, tie_word_embeddings=False)


@pytest.fixture(scope="module", params=FAMILIES)
def logits_case(request, tmp_path_factory) -> FamilyCase:
    """Logits tests: the other tiny checkpoints' scale, where 1e-4 is fp32 noise, with Gemma's tied head."""
    return FamilyCase(request.param, tmp_path_factory, LOGITS_INIT, tie_word_embeddings=True)


def test_the_config_and_manifest_carry_gemmas_traits(case):
    config = case.model.config
    assert (
        case.model.state_manifest.window_layers == LOCAL and case.model.state_manifest.window_size == WINDOW
    )
    assert case.model.kv_spec.window_layers == LOCAL and case.model.kv_spec.num_layers == 4
    assert (config.query_scale, config.final_softcap, config.tie_word_embeddings) == (24.0, 5.0, False)
    if case.kind == "gemma2":
        assert config.attn_softcap == 1.0 and config.local_rope is None and not config.qk_norm
    else:
        assert config.attn_softcap is None and config.qk_norm
        assert (config.rope.rope_type, config.rope.factor, config.rope.theta) == ("linear", 2.0, 50_000.0)
        assert (config.local_rope.rope_type, config.local_rope.theta) == ("default", 1_000.0)
    assert case.model.runtime.fused_decoder is None


def test_logits_match_transformers_on_every_path(logits_case):
    case = logits_case
    ids = ids_of(60)
    ref = case.reference(ids)
    for logits in (
        prompt_logits(case.model, ids, block_size=4),  # one prefill, local layers masked over block tables
        chunked_logits(case.model, ids, chunk=5),  # chunked prefill through rings
        chunked_logits(case.model, ids, chunk=1),  # one token per step through rings
        stepwise_logits(case.model, ids, prefill=13),  # decode over block tables
    ):
        assert (logits - ref).abs().max().item() <= TOL


def test_each_trait_changes_the_logits_far_beyond_the_tolerance(logits_case):
    """The logits test can fail: a window one longer (an off-by-one at its boundary), no soft-capping, or
    Gemma 3's global RoPE on the local layers each move transformers' own logits by far more than 1e-4."""
    case = logits_case
    ids = ids_of(60)
    ref = case.reference(ids)
    changes = [{"sliding_window": WINDOW + 1}, {"final_logit_softcapping": None}]
    if case.kind == "gemma2":
        changes.append({"attn_logit_softcapping": None})
    else:
        rope = case.hf.config.rope_parameters
        changes.append({"rope_parameters": {**rope, "sliding_attention": rope["full_attention"]}})
    for change in changes:
        other = case.reference(ids, case.variant(**change))
        assert (other - ref).abs().max().item() > 100 * TOL, change
    # the window only matters once a query has more than WINDOW keys: exact before, different after
    longer = case.reference(ids, case.variant(sliding_window=WINDOW + 1))
    assert (longer[:WINDOW] - ref[:WINDOW]).abs().max().item() <= 1e-6


def test_several_sequences_in_one_step_each_match_transformers(logits_case):
    case = logits_case
    prompts = [ids_of(n, seed=20 + n) for n in (1, 7, 19)]
    runner = PagedRunner(case.model, num_blocks=64, block_size=4, seed=3)
    seqs = [PagedSequence(tokens=[]) for _ in prompts]
    first = runner.step(seqs, [prompts[0], prompts[1][:4], prompts[2][:9]])
    second = runner.step(seqs[1:], [prompts[1][4:], prompts[2][9:]])  # a prefill continued in a batch
    third = runner.step(seqs, [[5], [6], [7]])  # three decodes, one of them far past the window
    assert (first[0] - case.reference(prompts[0])[-1]).abs().max().item() <= TOL
    assert (second[0] - case.reference(prompts[1])[-1]).abs().max().item() <= TOL
    assert (second[1] - case.reference(prompts[2])[-1]).abs().max().item() <= TOL
    for row, (prompt, token) in enumerate(zip(prompts, (5, 6, 7), strict=True)):
        assert (third[row] - case.reference(prompt + [token])[-1]).abs().max().item() <= TOL


def test_engine_greedy_equals_transformers_and_window_blocks_stay_flat(case):
    tokens = check_greedy_with_flat_window(case, WINDOW)
    assert len(set(tokens)) > 10  # a real continuation, not a collapsed repeat


# ---- GGUF: files written the way llama.cpp's converter writes Gemma 2 / Gemma 3 ---------------------------
# The oracle is transformers on the same weights from safetensors. Its own GGUF loader is no oracle here: on
# these files it takes query_pre_attn_scalar 256 and its default soft-caps and drops the linear RoPE scaling
# (transformers 5.24: logits off by 1-3).


def llama_cpp_shaped(kind: str):
    """A tiny model whose config is what llama.cpp derives from a Gemma GGUF file, so the file holds it
    exactly: the architecture's layer pattern (every 2nd / 6th layer global), queries scaled by the head size
    (``query_pre_attn_scalar`` is not stored; llama.cpp uses the head size below 27B), and Gemma 3's local
    layers at RoPE base 10000 (llama.cpp's fixed base when the file names none)."""
    overrides = {"layer_types": None, "query_pre_attn_scalar": 16}
    if kind == "gemma3":
        rope = {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        }
        overrides.update(num_hidden_layers=6, rope_parameters=rope)
    return tiny_hf_model(kind, initializer_range=LOGITS_INIT, **overrides)


@pytest.mark.parametrize("weights", ["native", "float32"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_a_gguf_file_loads_and_matches_transformers(kind, weights, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDGEN_CACHE_DIR", str(tmp_path / "cache"))
    hf = llama_cpp_shaped(kind)
    path = tmp_path / f"{kind}.gguf"
    write_gemma_gguf(path, hf)
    model = pg.Model(str(path), device="cpu", weights=weights)
    local = (0, 2) if kind == "gemma2" else (0, 1, 2, 3, 4)
    assert model.state_manifest.window_layers == local and model.config.sliding_window == WINDOW
    assert model.config.query_scale == 16.0
    ids = ids_of(40, seed=8)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    for logits in (prompt_logits(model, ids, block_size=4), chunked_logits(model, ids, chunk=3)):
        assert (logits - ref).abs().max().item() <= TOL


def test_a_gguf_pattern_array_and_local_base_are_read(logits_case, tmp_path):
    """Newer writers may spell the sliding layers per layer and the local RoPE base; both are honoured."""
    case = logits_case
    path = tmp_path / "pattern.gguf"
    write_gemma_gguf(path, case.hf, pattern=[True, False, True, True], local_base=1_000.0)
    config = gguf_config(open_gguf(path))
    assert config.windowed_layers == LOCAL and config.sliding_window == WINDOW
    if case.kind == "gemma3":
        assert config.local_rope.theta == 1_000.0 and config.rope.rope_type == "linear"


@pytest.mark.parametrize(
    ("kind", "replace", "message"),
    [
        ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping 50.0 is not part of Gemma 3"),
        (
            "gemma2",
            {"attention.sliding_window_pattern": [True, False, True]},
            "lists 3 layers, the model has 4",
        ),
        ("gemma2", {"attention.sliding_window_pattern": 0}, "must be a positive period, got 0"),
        ("gemma3", {"attention.sliding_window": 0}, "sliding_window must be a positive integer, got 0"),
    ],
)
def test_bad_gguf_metadata_is_refused_naming_the_key(kind, replace, message, tmp_path):
    hf = llama_cpp_shaped(kind)
    path = tmp_path / "bad.gguf"
    write_gemma_gguf(path, hf, replace=replace)
    with pytest.raises(ModelLoadError, match=message):
        gguf_config(open_gguf(path))
