"""The decoder state manifest: derivation, the ``pagedgen.json`` override, every refusal, and path selection.

docs/cache.md, "The decoder state manifest": groups by state kind (paged_kv, fixed_conv, fixed_recurrent), the
legacy dense paged group when nothing says otherwise, refusal of unknown kinds and duplicates, sliding-window
layers inside the paged group, exactly one paged group for the engine. Fixed-state groups are served by the
fixed-state pool on the dynamic path when the model keeps exactly the tensors they name, and refused
otherwise.
"""

from __future__ import annotations

import json

import pytest

import pagedgen as pg
from pagedgen.core.state_manifest import SlidingWindow, StateGroup, StateKind, StateManifest
from pagedgen.engine.cache_layout import model_manifest, plan_cache_layout
from pagedgen.errors import ModelLoadError, StateManifestError, UnsupportedStateError
from pagedgen.models.checkpoint_manifest import OVERRIDE_FILE, apply_manifest, derived_manifest, override_path
from pagedgen.models.config import config_from_hf
from pagedgen.models.synthetic import SyntheticModel
from tests.model.tiny_checkpoints import TINY_RAW, random_state, write_hf_dir

PAGED, CONV, RECURRENT = StateKind.PAGED_KV, StateKind.FIXED_CONV, StateKind.FIXED_RECURRENT


def test_legacy_manifest_is_one_dense_paged_group_not_written_into_groups():
    manifest = StateManifest(4)
    assert manifest.is_legacy and manifest.groups == ()
    assert manifest.paged_layers == manifest.full_layers == (0, 1, 2, 3)
    assert (manifest.window_layers, manifest.window_size, manifest.fixed_groups) == ((), None, ())
    assert manifest.dynamic_engine_problems() == []


def test_derived_from_the_config_keys_without_naming_a_family():
    raw = {**TINY_RAW, "num_hidden_layers": 4, "sliding_window": 8}
    raw["layer_types"] = ["sliding_attention", "full_attention"] * 2
    manifest = derived_manifest(config_from_hf(raw, "c"))
    assert manifest.is_legacy and manifest.sliding_window == SlidingWindow(8, (0, 2))
    assert (manifest.full_layers, manifest.window_layers) == ((1, 3), (0, 2))
    assert derived_manifest(config_from_hf(TINY_RAW, "c")) == StateManifest(2)


def test_explicit_groups_parse_with_fixed_kinds():
    data = {
        "state_groups": [
            {"kind": "paged_kv", "layers": [0, 2], "name": "attention"},
            {"kind": "fixed_conv", "layers": [1, 3]},
            {"kind": "fixed_recurrent", "layers": [1]},  # a layer may own more than one kind of state
        ],
        "sliding_window": {"size": 16, "layers": [2]},
    }
    manifest = StateManifest.from_dict(data, 4, "m.json")
    assert manifest.groups == (
        StateGroup(PAGED, (0, 2), "attention"),
        StateGroup(CONV, (1, 3)),
        StateGroup(RECURRENT, (1,)),
    )
    assert (manifest.paged_layers, manifest.full_layers, manifest.window_layers) == ((0, 2), (0,), (2,))
    assert [g.kind for g in manifest.fixed_groups] == [CONV, RECURRENT]


REFUSED = [
    ({"state_groups": [{"kind": "mamba", "layers": [0]}]}, "unknown kind 'mamba'"),
    (
        {"state_groups": [{"kind": "paged_kv", "layers": [0], "template": "k.%d"}]},
        r"unknown keys \['template'\]",
    ),
    ({"groups": []}, r"unknown manifest keys \['groups'\]"),
    ({"state_groups": {"kind": "paged_kv"}}, "state_groups must be a list"),
    ({"state_groups": ["paged_kv"]}, r"state_groups\[0\]: must be an object"),
    ({"state_groups": [{"kind": "paged_kv", "layers": [0, 0]}]}, r"repeated layer ids in \[0, 0\]"),
    (
        {"state_groups": [{"kind": "paged_kv", "layers": [0, 4]}]},
        "layer 4 is outside the decoder's layers 0..3",
    ),
    ({"state_groups": [{"kind": "paged_kv", "layers": [-1]}]}, "layer -1 is outside"),
    ({"state_groups": [{"kind": "paged_kv", "layers": [True]}]}, "layers must be integers"),
    ({"state_groups": [{"kind": "paged_kv", "layers": "0-3"}]}, "layers must be a list"),
    ({"state_groups": [{"kind": "paged_kv", "layers": []}]}, "needs at least one layer"),
    (
        {"state_groups": [{"kind": "paged_kv", "layers": [0, 1]}, {"kind": "paged_kv", "layers": [1, 2]}]},
        r"layers \[1\] already belong to another paged_kv group",
    ),
    (
        {
            "state_groups": [
                {"kind": "paged_kv", "layers": [0], "name": "a"},
                {"kind": "fixed_conv", "layers": [1], "name": "a"},
            ]
        },
        "duplicate group name 'a'",
    ),
    (
        {
            "state_groups": [{"kind": "paged_kv", "layers": [0, 1]}],
            "sliding_window": {"size": 8, "layers": [1, 2]},
        },
        r"layers \[2\] are windowed but belong to no paged_kv group",
    ),
    ({"sliding_window": {"size": 0, "layers": [1]}}, "size must be a positive int, got 0"),
    ({"sliding_window": {"size": 8, "layers": []}}, "names no layer"),
    ({"sliding_window": {"size": 8, "layers": [1], "every": 2}}, r"unknown keys \['every'\]"),
    ({"sliding_window": [8]}, "must be an object or null"),
]


@pytest.mark.parametrize(("data", "message"), REFUSED, ids=[m for _, m in REFUSED])
def test_bad_manifests_are_refused_naming_the_source_and_the_problem(data, message):
    with pytest.raises(StateManifestError, match=message) as raised:
        StateManifest.from_dict(data, 4, "ckpt/pagedgen.json")
    assert str(raised.value).startswith("ckpt/pagedgen.json")


@pytest.mark.parametrize(
    ("groups", "problem"),
    [
        (
            [StateGroup(PAGED, (0, 1)), StateGroup(PAGED, (2, 3))],
            "exactly one paged_kv group, the manifest has 2",
        ),
        ([StateGroup(CONV, (0, 1, 2, 3))], "exactly one paged_kv group, the manifest has 0"),
    ],
)
def test_the_engine_refuses_what_it_cannot_serve(groups, problem):
    model = SyntheticModel()
    model.state_manifest = StateManifest(4, tuple(groups), source="override")
    for dynamic in (True, False):
        with pytest.raises(UnsupportedStateError, match=f"cannot serve this model: override: .*{problem}"):
            pg.Engine(model, pg.EngineConfig(num_blocks=8, dynamic_batching=dynamic))


@pytest.mark.parametrize(
    ("group", "declared"),
    [
        (StateGroup(CONV, (1,)), "fixed_conv layers \\[1\\]"),
        (StateGroup(RECURRENT, (2,)), "fixed_recurrent layers \\[2\\]"),
    ],
)
def test_fixed_groups_need_the_models_state_tensors_and_the_dynamic_path(group, declared):
    model = SyntheticModel()
    model.state_manifest = StateManifest(4, (StateGroup(PAGED, (0, 1, 2, 3)), group), source="override")
    with pytest.raises(
        UnsupportedStateError, match=f"override: the manifest's {declared} are not the layers"
    ):
        pg.Engine(model, pg.EngineConfig(num_blocks=8))
    with pytest.raises(UnsupportedStateError, match="needs dynamic_batching=True"):
        pg.Engine(model, pg.EngineConfig(num_blocks=8, dynamic_batching=False))


def test_state_tensors_without_a_fixed_group_are_refused():
    model = SyntheticModel(hybrid=True)
    model.state_manifest = StateManifest(2, (StateGroup(PAGED, (0,)),), source="override")
    with pytest.raises(
        UnsupportedStateError, match=r"fixed_conv layers \[\] are not the layers .* \(\[1\]\)"
    ):
        pg.Engine(model, pg.EngineConfig(num_blocks=8))


def test_a_hybrid_model_gets_a_fixed_state_pool_on_the_dynamic_path():
    model = SyntheticModel(hybrid=True)
    layout = plan_cache_layout(model, pg.EngineConfig(block_size=4, max_batch_size=3))
    assert [s.name for s in layout.fixed] == ["mix"] and layout.fixed_bytes == 4 * 3 * 2 * 4
    stats = pg.Engine(model, pg.EngineConfig(num_blocks=8, max_batch_size=3)).stats()
    assert (stats.fixed_total_slots, stats.fixed_free_slots) == (3, 3)


def test_engine_paths_follow_the_manifest():
    dense = SyntheticModel()
    assert model_manifest(dense) == StateManifest(1, (), None, "SyntheticModel.kv_spec")
    layout = plan_cache_layout(dense, pg.EngineConfig(block_size=4))
    assert (layout.window, layout.window_bytes, layout.chunk_size) == (None, 0, None)
    windowed = SyntheticModel(window=6)
    layout = plan_cache_layout(windowed, pg.EngineConfig(block_size=4, max_batch_size=3, chunk_size=5))
    assert layout.window is not None and (layout.window.ring_blocks, layout.window.num_blocks) == (3, 9)
    assert layout.chunk_size == 5 and layout.bytes_per_block == windowed.kv_spec.bytes_per_full_block(4)
    # No chunk_size: C is the token budget; a larger chunk_size is capped to it.
    for chunk in (None, 100):
        config = pg.EngineConfig(block_size=4, max_scheduled_tokens=10, chunk_size=chunk)
        assert plan_cache_layout(windowed, config).chunk_size == 10
    static = plan_cache_layout(windowed, pg.EngineConfig(dynamic_batching=False))
    assert static.window is None and static.bytes_per_block == windowed.kv_spec.bytes_per_block(16)


def test_a_manifest_that_disagrees_with_the_kv_spec_is_refused():
    model = SyntheticModel(window=4)
    model.state_manifest = StateManifest(2, (), SlidingWindow(8, (1,)), "override")
    with pytest.raises(UnsupportedStateError, match="sliding window 8 on layers \\[1\\] disagrees"):
        pg.Engine(model, pg.EngineConfig(num_blocks=8))


# ---- the override file, through Model loading -----------------------------------------------------------


def checkpoint(tmp_path, manifest=None, **raw):
    config = {**TINY_RAW, **raw}
    path = write_hf_dir(tmp_path / "ckpt", config, random_state(config))
    if manifest is not None:
        (path / OVERRIDE_FILE).write_text(json.dumps(manifest))
    return path


def test_the_override_file_replaces_the_derived_window(tmp_path):
    path = checkpoint(
        tmp_path, {"decoder": {"sliding_window": {"size": 4, "layers": [1]}}}, sliding_window=64
    )
    model = pg.Model(str(path), device="cpu")
    assert model.state_manifest.sliding_window == SlidingWindow(4, (1,))
    assert (model.config.sliding_window, model.config.windowed_layers) == (4, (1,))
    assert (model.kv_spec.window_size, model.kv_spec.window_layers) == (4, (1,))
    assert override_path(path) == path / OVERRIDE_FILE


def test_the_override_can_turn_the_window_off(tmp_path):
    path = checkpoint(tmp_path, {"decoder": {"sliding_window": None}}, sliding_window=64)
    model = pg.Model(str(path), device="cpu")
    assert model.config.sliding_window is None and model.kv_spec.window_layers == ()


def test_without_an_override_the_config_decides(tmp_path):
    model = pg.Model(str(checkpoint(tmp_path, model_type="mistral", sliding_window=64)), device="cpu")
    assert model.state_manifest == derived_manifest(model.config)
    assert model.state_manifest.window_layers == (0, 1) and model.max_context == 256


@pytest.mark.parametrize(
    ("manifest", "message"),
    [
        (
            {"decoder": {"state_groups": [{"kind": "paged_kv", "layers": [0]}]}},
            r"layers \[1\] attend but belong",
        ),
        ({"model": {}}, 'expected {"decoder"'),
        ({"decoder": {"state_groups": [{"kind": "ssm", "layers": [0]}]}}, "unknown kind 'ssm'"),
    ],
)
def test_a_bad_override_file_is_refused_at_load(tmp_path, manifest, message):
    path = checkpoint(tmp_path, manifest)
    with pytest.raises(StateManifestError, match=message) as raised:
        pg.Model(str(path), device="cpu")
    assert str(path / OVERRIDE_FILE) in str(raised.value)


def test_a_broken_override_file_is_refused_at_load(tmp_path):
    path = checkpoint(tmp_path)
    (path / OVERRIDE_FILE).write_text("{not json")
    with pytest.raises(StateManifestError, match="not a valid JSON file"):
        pg.Model(str(path), device="cpu")


def test_fixed_state_groups_on_an_attention_only_runtime_load_but_the_engine_refuses_them(tmp_path):
    groups = [{"kind": "paged_kv", "layers": [0, 1]}, {"kind": "fixed_conv", "layers": [1]}]
    model = pg.Model(str(checkpoint(tmp_path, {"decoder": {"state_groups": groups}})), device="cpu")
    assert [g.kind for g in model.state_manifest.fixed_groups] == [CONV]
    with pytest.raises(
        UnsupportedStateError, match=r"fixed_conv layers \[1\] are not the layers .* \(\[\]\)"
    ):
        pg.Engine(model, pg.EngineConfig(num_blocks=8))
    with pytest.raises(UnsupportedStateError):
        pg.Engine(model, pg.EngineConfig(num_blocks=8, dynamic_batching=False))


def test_the_rings_come_off_the_kv_budget_before_the_full_pool_is_sized():
    model = SyntheticModel(window=6)  # layer 0 full, layer 1 windowed; fp32, 1 head of 1 dim
    spec = model.kv_spec
    config = pg.EngineConfig(block_size=4, max_batch_size=3, chunk_size=5, kv_cache_memory_bytes=4096)
    rings = 3 * 3 * spec.bytes_per_window_block(4)  # 3 residents x R = ceil((5 + 6 - 1) / 4) = 3 blocks
    engine = pg.Engine(model, config)
    stats = engine.stats()
    assert (stats.window_total_blocks, stats.window_free_blocks) == (9, 9)
    assert stats.total_blocks == (4096 - rings) // spec.bytes_per_full_block(4)
    too_small = pg.EngineConfig(block_size=4, max_batch_size=3, chunk_size=5, kv_cache_memory_bytes=rings)
    with pytest.raises(pg.EngineError, match="does not hold the sliding-window rings"):
        pg.Engine(model, too_small)


def test_a_model_without_full_attention_layers_pays_only_for_its_rings(tmp_path):
    model = pg.Model(str(checkpoint(tmp_path, model_type="mistral", sliding_window=16)), device="cpu")
    spec = model.kv_spec
    assert spec.full_layers == () and spec.bytes_per_full_block(4) == 0
    rings = 2 * 5 * spec.bytes_per_window_block(4)  # R = ceil((5 + 16 - 1) / 4) = 5 blocks per resident
    config = pg.EngineConfig(block_size=4, max_batch_size=2, chunk_size=5, kv_cache_memory_bytes=rings)
    stats = pg.Engine(model, config).stats()
    # The full pool holds no storage: its blocks only track positions, sized for every whole context.
    assert (stats.window_total_blocks, stats.total_blocks) == (10, 2 * 256 // 4)


# ---- LFM2: convolution layers keep fixed_conv state, attention layers paged K/V -------------------------

LFM2_RAW = {
    **{
        k: v
        for k, v in TINY_RAW.items()
        if k not in ("head_dim", "rms_norm_eps", "architectures", "tie_word_embeddings")
    },
    "model_type": "lfm2",
    "num_hidden_layers": 4,
    "layer_types": ["conv", "full_attention", "conv", "conv"],
    "conv_L_cache": 3,
    "block_auto_adjust_ff_dim": False,
    "norm_eps": 1e-5,
}


def test_an_lfm2_config_derives_a_paged_and_a_fixed_conv_group():
    config = config_from_hf(LFM2_RAW, "c")
    assert (config.conv_layers, config.attention_layers, config.conv_kernel) == ((0, 2, 3), (1,), 3)
    assert config.tie_word_embeddings and config.qk_norm and config.rms_norm_eps == 1e-5
    assert config.intermediate_size == 96 and config.head_dim == 16
    manifest = derived_manifest(config)
    assert [(g.kind, g.layers) for g in manifest.groups] == [(PAGED, (1,)), (CONV, (0, 2, 3))]
    assert apply_manifest(config, manifest) == config
    raw = {k: v for k, v in LFM2_RAW.items() if k != "layer_types"}
    assert config_from_hf({**raw, "full_attn_idxs": [1, 3]}, "c").conv_layers == (0, 2)


@pytest.mark.parametrize(
    ("adjust", "inner"), [({"block_auto_adjust_ff_dim": True}, 64), ({"block_ffn_dim_multiplier": 1.0}, 256)]
)
def test_the_lfm2_mlp_width_follows_the_block_rule(adjust, inner):
    raw = {**LFM2_RAW, "block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": None, **adjust}
    assert (
        config_from_hf(raw, "c").intermediate_size == inner
    )  # int(2 * 96 / 3), then up to a multiple of 256


def test_bad_lfm2_layer_types_are_refused():
    with pytest.raises(ModelLoadError, match="layer_types must list 4"):
        config_from_hf({**LFM2_RAW, "layer_types": ["conv", "mamba", "conv", "conv"]}, "c")


@pytest.mark.parametrize(
    ("groups", "window", "message"),
    [
        ([StateGroup(PAGED, (0, 1)), StateGroup(CONV, (2, 3))], None, r"layers \[0\] are convolution layers"),
        ([StateGroup(PAGED, (1,)), StateGroup(CONV, (0, 2))], None, r"convolution layers \[3\] belong to no"),
        ([StateGroup(PAGED, (0, 2, 3)), StateGroup(CONV, (1,))], None, r"layers \[1\] attend"),
        ([StateGroup(PAGED, (1,)), StateGroup(CONV, (0, 2, 3))], SlidingWindow(4, (1,)), "no sliding-window"),
    ],
)
def test_an_lfm2_override_must_match_what_its_layers_keep(groups, window, message):
    config = config_from_hf(LFM2_RAW, "c")
    with pytest.raises(StateManifestError, match=message):
        apply_manifest(config, StateManifest(4, tuple(groups), window, "override"))


GEMMA3_RAW = {
    **TINY_RAW,
    "model_type": "gemma3_text",
    "hidden_activation": "gelu_pytorch_tanh",
    "num_hidden_layers": 4,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
}


def test_gemma3s_local_layers_are_the_window_layers_and_cannot_be_moved():
    """The derived manifest windows Gemma 3's local layers; an override may resize the window but not move
    it, since those layers also rotate with their own RoPE base."""
    config = config_from_hf(GEMMA3_RAW, "c")
    manifest = derived_manifest(config)
    assert manifest.window_layers == (0, 2, 3) and manifest.window_size == 8
    assert apply_manifest(config, manifest) == config
    resized = apply_manifest(config, StateManifest(4, (), SlidingWindow(16, (0, 2, 3)), "override"))
    assert resized.sliding_window == 16 and resized.windowed_layers == (0, 2, 3)
    for moved in (SlidingWindow(8, (0, 1)), None):
        with pytest.raises(StateManifestError, match="cannot move them"):
            apply_manifest(config, StateManifest(4, (), moved, "override"))


# ---- Bamba: a Mamba-2 layer keeps fixed_conv and fixed_recurrent state, attention layers paged K/V -------

BAMBA_RAW = {
    **{k: v for k, v in TINY_RAW.items() if k not in ("head_dim", "architectures")},
    "model_type": "bamba",
    "num_hidden_layers": 4,
    "attn_layer_indices": [1],
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_d_state": 16,
    "mamba_n_groups": 2,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
}


def test_a_bamba_config_derives_a_paged_a_fixed_conv_and_a_fixed_recurrent_group():
    config = config_from_hf(BAMBA_RAW, "c")
    assert (config.mamba_layers, config.attention_layers) == ((0, 2, 3), (1,))
    assert (config.conv_state_layers, config.recurrent_state_layers) == ((0, 2, 3), (0, 2, 3))
    assert (config.mamba_inner, config.mamba_conv_dim, config.rotary_dim) == (128, 192, 8)
    manifest = derived_manifest(config)
    assert [(g.kind, g.layers) for g in manifest.groups] == [
        (PAGED, (1,)),
        (CONV, (0, 2, 3)),
        (RECURRENT, (0, 2, 3)),
    ]
    assert apply_manifest(config, manifest) == config
    assert config_from_hf({**BAMBA_RAW, "mamba_d_head": "auto"}, "c") == config


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        (
            [StateGroup(PAGED, (1,)), StateGroup(CONV, (0, 2, 3))],
            r"recurrent layers \[0, 2, 3\] belong to no",
        ),
        (
            [StateGroup(PAGED, (1,)), StateGroup(RECURRENT, (0, 2, 3))],
            r"convolution layers \[0, 2, 3\] belong",
        ),
        (
            [StateGroup(PAGED, (1, 2)), StateGroup(CONV, (0, 2, 3)), StateGroup(RECURRENT, (0, 2, 3))],
            r"layers \[2\] are convolution layers",
        ),
    ],
)
def test_a_bamba_override_must_match_what_its_layers_keep(groups, message):
    config = config_from_hf(BAMBA_RAW, "c")
    with pytest.raises(StateManifestError, match=message):
        apply_manifest(config, StateManifest(4, tuple(groups), None, "override"))
