"""LFM2 (gated short convolutions + attention; conv state in the fixed-state pool) against transformers.

A tiny random-weight ``Lfm2ForCausalLM`` written by transformers (layers conv, attention, conv, conv;
3-tap convolutions): fp32 logits within 1e-4 at every position on every path (one prefill, chunked prefill
whose chunks carry the conv state, one token per step, a prefill then decode steps, several sequences in one
step); a GGUF file written as llama.cpp writes LFM2 loads and gives the same logits. What every family
runs through the engine (greedy tokens, batches, chunks, rollbacks, the slots returned) is in
test_family_conformance.py.
"""

from __future__ import annotations

import pytest

import pagedgen as pg
from pagedgen.core.state_manifest import StateKind
from tests.model.family_cases import LOGITS_INIT, FamilyCase
from tests.model.hf_cases import (
    ids_of,
)
from tests.model.paged_runner import (
    PagedRunner,
    PagedSequence,
    chunked_logits,
    prompt_logits,
    stepwise_logits,
)

pytestmark = pytest.mark.model

TOL = 1e-4


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> FamilyCase:
    return FamilyCase("lfm2", tmp_path_factory)


@pytest.fixture(scope="module")
def logits_case(tmp_path_factory) -> FamilyCase:
    return FamilyCase("lfm2", tmp_path_factory, LOGITS_INIT)


def test_the_manifest_puts_attention_in_the_paged_group_and_convolutions_in_fixed_conv(case):
    manifest = case.model.state_manifest
    assert [(g.kind, g.layers) for g in manifest.groups] == [
        (StateKind.PAGED_KV, (1,)),
        (StateKind.FIXED_CONV, (0, 2, 3)),
    ]
    assert case.model.kv_spec.num_layers == 1
    specs = case.model.fixed_state_specs
    assert [(s.name, s.layer, s.row_shape) for s in specs] == [
        ("conv.0", 0, (2, 64)),
        ("conv.2", 2, (2, 64)),
        ("conv.3", 3, (2, 64)),
    ]


def test_logits_match_transformers_on_every_path(logits_case):
    case = logits_case
    ids = ids_of(60)
    ref = case.reference(ids)
    for logits in (
        prompt_logits(case.model, ids),  # one prefill: every conv window starts from zeros
        chunked_logits(case.model, ids, chunk=5),  # each chunk continues the previous chunk's state
        chunked_logits(case.model, ids, chunk=2),  # chunks shorter than the conv window
        chunked_logits(case.model, ids, chunk=1),  # one token per step
        stepwise_logits(case.model, ids, prefill=13),
    ):
        assert (logits - ref).abs().max().item() <= TOL


def test_several_sequences_in_one_step_each_match_transformers(logits_case):
    case = logits_case
    prompts = [ids_of(n, seed=20 + n) for n in (1, 7, 19)]
    runner = PagedRunner(case.model, num_blocks=64, block_size=4, seed=3)
    seqs = [PagedSequence(tokens=[]) for _ in prompts]
    first = runner.step(seqs, [prompts[0], prompts[1][:4], prompts[2][:9]])
    second = runner.step(seqs[1:], [prompts[1][4:], prompts[2][9:]])  # a prefill continued in a batch
    assert (first[0] - case.reference(prompts[0])[-1]).abs().max().item() <= TOL
    assert (second[0] - case.reference(prompts[1])[-1]).abs().max().item() <= TOL
    assert (second[1] - case.reference(prompts[2])[-1]).abs().max().item() <= TOL


# ---- GGUF: a file written the way llama.cpp's converter writes LFM2 ------------------------------------


def write_lfm2_gguf(path, hf) -> None:
    """LFM2 as ``convert_hf_to_gguf.py`` writes it: arch ``lfm2``, a per-layer KV-head array (0 for a
    convolution layer), ``shortconv.l_cache``, the conv weight squeezed to ``[hidden, L]``, names from gguf's
    own tensor map (so pagedgen's reader is checked against llama.cpp's names, not against itself)."""
    import gguf

    from tests.model.tiny_checkpoints import add_byte_level_tokenizer, add_tensor, finish_gguf, hf_state

    c = hf.config
    writer = gguf.GGUFWriter(str(path), "lfm2")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)  # the tiny config takes it as given (no block rule)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv([c.num_key_value_heads if t == "full_attention" else 0 for t in c.layer_types])
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_shortconv_l_cache(c.conv_L_cache)
    add_byte_level_tokenizer(writer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LFM2, c.num_hidden_layers)
    f32 = gguf.GGMLQuantizationType.F32
    for name, array in hf_state(hf).items():
        if "conv.conv" in name:
            array = array.squeeze(1)  # the converter's modify_tensors: the conv op wants a 2-D tensor
        add_tensor(writer, names.get_name(name, try_suffixes=(".weight", ".bias")), array, f32)
    finish_gguf(writer)


@pytest.mark.parametrize("weights", ["native", "float32"])
def test_a_gguf_file_loads_and_matches_transformers(logits_case, tmp_path, monkeypatch, weights):
    monkeypatch.setenv("PAGEDGEN_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "lfm2.gguf"
    write_lfm2_gguf(path, logits_case.hf)
    model = pg.Model(str(path), device="cpu", weights=weights)
    assert model.config.conv_layers == (0, 2, 3) and model.kv_spec.num_layers == 1
    assert [(g.kind, g.layers) for g in model.state_manifest.groups] == [
        (StateKind.PAGED_KV, (1,)),
        (StateKind.FIXED_CONV, (0, 2, 3)),
    ]
    ids = ids_of(40, seed=8)
    ref = logits_case.reference(ids)
    for logits in (prompt_logits(model, ids), chunked_logits(model, ids, chunk=3)):
        assert (logits - ref).abs().max().item() <= TOL
