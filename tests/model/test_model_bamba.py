"""Bamba (Mamba-2 mixers + attention; conv window and SSM state in the fixed-state pool) against transformers.

A tiny random-weight ``BambaForCausalLM`` written by transformers with ``save_pretrained`` and loaded from
that safetensors directory (layers mamba, attention, mamba, mamba; 8 SSM heads in 2 B/C groups, d_state 16,
4-tap convolutions, RoPE on half of each head): fp32 logits within 1e-4 at every position on every path
(one prefill, chunked prefill whose chunks carry the conv window and the SSM state, one token per step, a
prefill then decode steps, several sequences in one step, a clamped time step). Configs the runtime does
not implement are refused by name. What every family runs through the engine (greedy tokens, batches,
chunks, second turns, rollbacks, the slots returned) is in test_family_conformance.py.

GraniteMoeHybrid with a dense MLP (``num_local_experts: 0``) runs on the same runtime: a tiny one (same
layers, Granite's multipliers all different from 1, attention without RoPE as in Granite 4.0, or with it)
matches transformers on every path and through the engine; its mixture-of-experts variant is refused.
"""

from __future__ import annotations

import json

import pytest
import torch

import pagedgen as pg
from pagedgen.core.state_manifest import StateKind
from pagedgen.errors import ModelLoadError, StateManifestError
from pagedgen.models.bamba import BambaForCausalLM
from pagedgen.models.config import config_from_hf
from tests.helpers import drain, submit, tokens_of
from tests.model.family_cases import LOGITS_INIT, FamilyCase
from tests.model.hf_cases import (
    ids_of,
    small_engine,
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
MAMBA, ATTENTION = (0, 2, 3), (1,)


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> FamilyCase:
    return FamilyCase("bamba", tmp_path_factory)


@pytest.fixture(scope="module")
def logits_case(tmp_path_factory) -> FamilyCase:
    return FamilyCase("bamba", tmp_path_factory, LOGITS_INIT)


def test_the_manifest_puts_mamba_layers_in_a_conv_and_a_recurrent_group(case):
    manifest = case.model.state_manifest
    assert [(g.kind, g.layers) for g in manifest.groups] == [
        (StateKind.PAGED_KV, ATTENTION),
        (StateKind.FIXED_CONV, MAMBA),
        (StateKind.FIXED_RECURRENT, MAMBA),
    ]
    assert case.model.kv_spec.num_layers == 1
    conv_dim = 2 * 64 + 2 * 2 * 16  # x (expand x hidden), then B and C of both groups
    assert [(s.name, s.kind, s.layer, s.row_shape, s.dtype) for s in case.model.fixed_state_specs] == [
        spec
        for i in MAMBA
        for spec in (
            (f"mamba_conv.{i}", StateKind.FIXED_CONV, i, (3, conv_dim), torch.float32),
            (f"mamba_ssm.{i}", StateKind.FIXED_RECURRENT, i, (8, 16, 16), torch.float32),
        )
    ]
    assert case.model.config.partial_rotary_factor == 0.5 and case.model.config.rotary_dim == 8


def test_a_half_precision_model_keeps_its_conv_window_in_its_dtype_and_the_ssm_state_in_float32(case):
    runtime = BambaForCausalLM(case.model.config, torch.bfloat16, torch.device("cpu"))
    assert {(s.kind, s.dtype) for s in runtime.fixed_state_specs} == {
        (StateKind.FIXED_CONV, torch.bfloat16),
        (StateKind.FIXED_RECURRENT, torch.float32),
    }


def test_a_bfloat16_model_runs_every_path_near_the_float32_logits(logits_case):
    model = pg.Model(str(logits_case.path), device="cpu", dtype="bf16")
    ids = ids_of(40, seed=13)
    ref = prompt_logits(logits_case.model, ids)
    for logits in (prompt_logits(model, ids), chunked_logits(model, ids, chunk=3)):
        assert (logits - ref).abs().max().item() <= 0.2  # bf16 rounding of weights and activations


def test_logits_match_transformers_on_every_path(logits_case):
    case = logits_case
    # longer than the scan's chunk (pagedgen.ops.mixers.ssm.CHUNK): a prefill carries state inside
    ids = ids_of(80)
    ref = case.reference(ids)
    for logits in (
        prompt_logits(case.model, ids),  # one prefill: every state starts from zeros
        chunked_logits(case.model, ids, chunk=5),  # each chunk continues the previous chunk's states
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
    tokens = [int(row.argmax()) for row in second]
    third = runner.step(seqs[1:], [[tokens[0]], [tokens[1]]])  # a decode step of both rows at once
    for row, prompt, token in zip(third, prompts[1:], tokens, strict=True):
        assert (row - case.reference(prompt + [token])[-1]).abs().max().item() <= TOL


def test_a_clamped_time_step_matches_transformers(tmp_path_factory):
    case = FamilyCase("bamba", tmp_path_factory, LOGITS_INIT, time_step_limit=(0.05, 0.5))
    assert case.model.config.time_step_limit == (0.05, 0.5)
    ids = ids_of(30, seed=9)
    ref = case.reference(ids)
    for logits in (prompt_logits(case.model, ids), chunked_logits(case.model, ids, chunk=4)):
        assert (logits - ref).abs().max().item() <= TOL


def test_a_sharded_checkpoint_loads_and_matches_transformers(logits_case, tmp_path):
    logits_case.hf.save_pretrained(tmp_path, max_shard_size="50KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model = pg.Model(str(tmp_path), device="cpu")
    ids = ids_of(20, seed=11)
    assert (prompt_logits(model, ids) - logits_case.reference(ids)).abs().max().item() <= TOL


def raw_config(case: FamilyCase) -> dict:
    return json.loads((case.path / "config.json").read_text())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"mamba_d_head": 12}, r"mamba_n_heads \(8\) x mamba_d_head \(12\) must equal mamba_expand"),
        ({"mamba_n_groups": 3}, r"mamba_n_heads \(8\) must be a multiple of mamba_n_groups \(3\)"),
        ({"attn_layer_indices": []}, "attn_layer_indices names no attention layer: a Mamba-only model"),
        ({"attn_layer_indices": [4]}, r"attn_layer_indices must list layer ids 0\.\.3"),
        ({"time_step_limit": [0.0]}, "time_step_limit must be"),
        ({"time_step_limit": [0.5, 0.1]}, "time_step_limit must be 0 <= low <= high"),
        ({"mamba_d_conv": 1}, "mamba_conv_kernel must be >= 2"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope scaling type 'yarn'"),
    ],
)
def test_an_unsupported_config_is_refused_naming_the_field(case, change, message):
    with pytest.raises(ModelLoadError, match=message):
        config_from_hf({**raw_config(case), **change}, "config.json")


def test_a_manifest_override_that_drops_the_recurrent_group_is_refused(case, tmp_path):
    case.hf.save_pretrained(tmp_path)
    groups = [
        {"kind": "paged_kv", "layers": list(ATTENTION)},
        {"kind": "fixed_conv", "layers": list(MAMBA)},
        {"kind": "fixed_recurrent", "layers": [0, 2]},
    ]
    (tmp_path / "pagedgen.json").write_text(json.dumps({"decoder": {"state_groups": groups}}))
    with pytest.raises(
        StateManifestError, match=r"recurrent layers \[3\] belong to no fixed_recurrent group"
    ):
        pg.Model(str(tmp_path), device="cpu")


# ---- GraniteMoeHybrid, dense MLP: the same mixers under Granite's names and multipliers -----------------


@pytest.fixture(scope="module", params=["nope", "rope"])
def granite_logits_case(request, tmp_path_factory) -> FamilyCase:
    return FamilyCase(
        "granitemoehybrid", tmp_path_factory, LOGITS_INIT, position_embedding_type=request.param
    )


def test_granite_hybrid_logits_match_transformers_on_every_path(granite_logits_case):
    case = granite_logits_case
    config = case.model.config
    assert (config.architecture, config.mamba_layers, config.intermediate_size) == (
        "granitemoehybrid",
        MAMBA,
        96,
    )
    assert (config.embedding_multiplier, config.residual_multiplier) == (1.5, 0.7)
    assert (config.attention_scale, config.logits_scaling) == (0.2, 2.5)
    assert config.rotary_dim == (16 if case.hf.config.position_embedding_type == "rope" else 0)
    assert [(g.kind, g.layers) for g in case.model.state_manifest.groups] == [
        (StateKind.PAGED_KV, ATTENTION),
        (StateKind.FIXED_CONV, MAMBA),
        (StateKind.FIXED_RECURRENT, MAMBA),
    ]
    ids = ids_of(80, seed=12)
    ref = case.reference(ids)
    for logits in (
        prompt_logits(case.model, ids),
        chunked_logits(case.model, ids, chunk=5),
        stepwise_logits(case.model, ids, prefill=13),
    ):
        assert (logits - ref).abs().max().item() <= TOL


def test_granite_hybrid_engine_greedy_equals_transformers(tmp_path_factory):
    case = FamilyCase("granitemoehybrid", tmp_path_factory)
    prompts = [ids_of(24, seed=1), ids_of(9, seed=2)]
    eng = small_engine(case.model, max_scheduled_tokens=12)
    requests = [submit(eng, p, 25, ignore_eos=True) for p in prompts]
    tokens = tokens_of(drain(eng))
    assert [tokens[r] for r in requests] == [case.greedy(p, 25) for p in prompts]


def test_granite_hybrid_reads_the_legacy_layer_type_names(granite_logits_case):
    raw = raw_config(granite_logits_case)
    legacy = {**raw, "layer_types": ["mamba", "attention", "mamba", "mamba"]}
    assert config_from_hf(legacy, "config.json") == config_from_hf(raw, "config.json")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_local_experts": 8}, "num_local_experts is 8: GraniteMoeHybrid's mixture-of-experts MLP"),
        ({"num_local_experts": None}, "num_local_experts is None"),
        ({"position_embedding_type": "alibi"}, "position_embedding_type 'alibi' is not supported"),
        ({"layer_types": ["mamba"] * 4}, "layer_types names no attention layer"),
        ({"layer_types": ["mamba", "moe", "mamba", "mamba"]}, "layer_types must list 4 of"),
        ({"residual_multiplier": "big"}, "'residual_multiplier' must be a number"),
        ({"logits_scaling": 0}, "logits_scaling must be positive"),
    ],
)
def test_an_unsupported_granite_hybrid_config_is_refused_naming_the_field(
    granite_logits_case, change, message
):
    with pytest.raises(ModelLoadError, match=message):
        config_from_hf({**raw_config(granite_logits_case), **change}, "config.json")


def test_a_granite_hybrid_moe_checkpoint_is_refused_at_load(tmp_path):
    hf = tiny_hf_model("granitemoehybrid", num_local_experts=4, num_experts_per_tok=2)
    hf.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="num_local_experts is 4"):
        pg.Model(str(tmp_path), device="cpu")
