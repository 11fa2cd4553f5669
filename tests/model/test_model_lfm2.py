"""LFM2 (gated short convolutions + attention; conv state in the fixed-state pool) against transformers.

A tiny random-weight ``Lfm2ForCausalLM`` written by transformers (layers conv, attention, conv, conv;
3-tap convolutions): fp32 logits within 1e-4 at every position on every path (one prefill, chunked prefill
whose chunks carry the conv state, one token per step, a prefill then decode steps, several sequences in one
step); through the engine, greedy tokens equal transformers'; a mixed batch equals each request alone; chunked
prefill equals unchunked; a rolled-back step at every phase leaves every fixed slot byte-identical and the
retry's tokens exact; the conv slots return with the blocks.
"""

from __future__ import annotations

import pytest
import torch

import pagedgen as pg
from pagedgen.core.state_manifest import StateKind
from tests.helpers import RECOVERABLE, RECOVERABLE_IDS
from tests.model.hf_cases import (
    check_chunked_equals_unchunked,
    check_fatal_step,
    check_greedy_and_slot_returns,
    check_mixed_batch,
    check_rollback_at,
    check_second_turn,
    greedy_by_forwards,
    ids_of,
    resident_pair,
)
from tests.model.paged_runner import (
    PagedRunner,
    PagedSequence,
    chunked_logits,
    prompt_logits,
    stepwise_logits,
)
from tests.model.tiny_checkpoints import tiny_hf_model

pytestmark = pytest.mark.model

TOL = 1e-4
INIT = 0.3  # engine tests: weights large enough that greedy continuations do not collapse into a repeat
LOGITS_INIT = 0.1  # logits tests: the other tiny checkpoints' scale, where 1e-4 is fp32 noise


class Case:
    def __init__(self, tmp_path_factory, init):
        self.hf = tiny_hf_model("lfm2", initializer_range=init)
        path = tmp_path_factory.mktemp("lfm2")
        self.hf.save_pretrained(path)
        self.model = pg.Model(str(path), device="cpu")

    def reference(self, ids):
        with torch.no_grad():
            return self.hf(torch.tensor([ids])).logits[0].float()

    def greedy(self, ids, n):
        """Greedy continuation by whole-sequence forwards (no cache: the oracle of every step)."""
        return greedy_by_forwards(self.hf, ids, n)


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> Case:
    return Case(tmp_path_factory, INIT)


@pytest.fixture(scope="module")
def logits_case(tmp_path_factory) -> Case:
    return Case(tmp_path_factory, LOGITS_INIT)


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


def test_engine_greedy_equals_transformers_and_the_slot_returns_on_close(case):
    check_greedy_and_slot_returns(case)


PROMPTS = [(3, 30), (17, 20), (41, 10)]  # (prompt length, generated tokens)


def test_a_mixed_batch_equals_each_request_alone(case):
    check_mixed_batch(case, PROMPTS)


def test_chunked_prefill_equals_unchunked(case):
    check_chunked_equals_unchunked(case)


def test_a_second_turn_continues_the_conv_state(case):
    check_second_turn(case)


def scenario(case: Case) -> tuple[pg.Engine, list[pg.Request]]:
    """A decoding request and a partial prefill, both resident (their conv state mid-stream)."""
    return resident_pair(case.model, generate=20, steps=6, past=10)


@pytest.mark.parametrize("phase, error", RECOVERABLE, ids=RECOVERABLE_IDS)
def test_a_rollback_at_every_phase_leaves_the_state_exact(case, phase, error):
    def holds_both_states(before: dict) -> None:
        assert len(before["fixed"]["owners"]) == 2

    check_rollback_at(lambda: scenario(case), phase, error, holds_both_states)


@pytest.mark.parametrize("phase", ["execute", "prepare", "commit_cache"])
def test_a_fatal_step_fails_every_turn_and_the_slots_return_on_close(case, phase):
    check_fatal_step(lambda: scenario(case), phase, ("fixed_free_slots", "fixed_total_slots"))


def test_the_static_path_refuses_a_fixed_state_model(case):
    with pytest.raises(pg.EngineError, match="needs dynamic_batching=True"):
        pg.Engine(case.model, pg.EngineConfig(num_blocks=16, dynamic_batching=False))


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
