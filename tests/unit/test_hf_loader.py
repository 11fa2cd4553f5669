"""HF checkpoint dirs: config.json parsing (transformers 4 and 5 spellings), family traits, shards."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from pagedgen.errors import ModelLoadError, UnsupportedArchitectureError
from pagedgen.models.config import ModelConfig, RopeConfig, config_from_hf
from pagedgen.models.hf_loader import read_hf_config, read_hf_weights, weight_files
from pagedgen.models.llama import rope_inv_freq
from tests.model.tiny_checkpoints import TINY_RAW

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_llama_config_both_spellings_parse_the_same():
    v4 = {**TINY_RAW, "rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE}
    v5 = {**TINY_RAW, "rope_parameters": {**LLAMA3_ROPE, "rope_theta": 500000.0}}
    v5.pop("rope_theta")
    a, b = config_from_hf(v4, "v4"), config_from_hf(v5, "v5")
    assert a == b
    assert a.rope == RopeConfig(500000.0, "llama3", 8.0, 1.0, 4.0, 8192)
    assert (a.architecture, a.qkv_bias, a.qk_norm, a.max_context) == ("llama", False, False, 256)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}, ("qwen2", True, False)),
        ({"model_type": "qwen3", "attention_bias": False}, ("qwen3", False, True)),
        ({"model_type": "mistral"}, ("mistral", False, False)),
        ({"model_type": "llama", "attention_bias": True}, ("llama", True, False)),
        ({"model_type": None, "architectures": ["Qwen3ForCausalLM"]}, ("qwen3", False, True)),
    ],
)
def test_family_traits(overrides, expected):
    config = config_from_hf({**TINY_RAW, **overrides}, "c")
    assert (config.architecture, config.qkv_bias, config.qk_norm) == expected


@pytest.mark.parametrize(
    ("keys", "window", "layers"),
    [
        ({"model_type": "mistral", "sliding_window": 128}, 128, (0, 1)),  # every layer, context not clamped
        ({"model_type": "qwen2", "sliding_window": 128}, None, ()),  # Qwen2: off unless use_sliding_window
        ({"model_type": "qwen2", "sliding_window": 128, "use_sliding_window": True}, 128, (0, 1)),
        (
            {"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True, "max_window_layers": 1},
            64,
            (1,),
        ),
        ({"model_type": "mistral", "sliding_window": 128, "use_sliding_window": False}, None, ()),
        ({"sliding_window": 32, "layer_types": ["sliding_attention", "full_attention"]}, 32, (0,)),
        ({"sliding_window": 32, "layer_types": ["full_attention", "full_attention"]}, None, ()),
        ({"model_type": "mistral", "sliding_window": 256}, None, ()),  # window >= context: never hides a key
    ],
)
def test_sliding_window_layers_from_the_config(keys, window, layers):
    config = config_from_hf({**TINY_RAW, **keys}, "c")
    assert (config.sliding_window, config.windowed_layers, config.max_context) == (window, layers, 256)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"sliding_window": 32, "layer_types": ["sliding_attention"]}, "must list 2 layer types"),
        ({"sliding_window": 32, "layer_types": ["conv", "full_attention"]}, "'conv'"),
        ({"model_type": "mistral", "sliding_window": -4}, "positive integer"),
    ],
)
def test_bad_sliding_window_keys_are_refused(keys, message):
    with pytest.raises(ModelLoadError, match=message):
        config_from_hf({**TINY_RAW, **keys}, "c")


def test_head_dim_defaults_to_hidden_over_heads():
    raw = {**TINY_RAW}
    raw.pop("head_dim")
    assert config_from_hf(raw, "c").head_dim == 16


@pytest.mark.parametrize(
    "config",
    [
        ModelConfig(
            "llama", 260, 64, 96, 2, 4, 2, 16, 256, rope=RopeConfig(5e5, "llama3", 8.0, 1.0, 4.0, 64)
        ),
        ModelConfig("qwen3", 100, 32, 64, 3, 4, 1, 32, 128, tie_word_embeddings=True, qk_norm=True),
        ModelConfig("qwen2", 100, 32, 64, 1, 2, 2, 16, 64, qkv_bias=True, eos_token_ids=(5, 7)),
        ModelConfig(
            "mistral", 100, 32, 64, 1, 2, 2, 16, 64, sliding_window=32, rope=RopeConfig(1e4, "linear", 2.0)
        ),
        ModelConfig(
            "qwen2", 100, 32, 64, 3, 2, 2, 16, 64, qkv_bias=True, sliding_window=8, window_layers=(1, 2)
        ),
        ModelConfig(
            "gemma2",
            100,
            32,
            64,
            3,
            2,
            1,
            16,
            64,
            tie_word_embeddings=True,
            sliding_window=8,
            window_layers=(0, 2),
            query_scale=24.0,
            attn_softcap=50.0,
            final_softcap=30.0,
        ),
        ModelConfig(
            "gemma3_text",
            100,
            32,
            64,
            3,
            2,
            1,
            16,
            64,
            tie_word_embeddings=True,
            qk_norm=True,
            sliding_window=8,
            window_layers=(0, 1),
            query_scale=16.0,
            final_softcap=None,
            rope=RopeConfig(1e6, "linear", 8.0),
            local_rope=RopeConfig(1e4),
        ),
    ],
)
def test_to_hf_dict_round_trips(config):
    assert config_from_hf(config.to_hf_dict(), "c") == config


def test_a_gemma_config_dict_is_one_transformers_accepts():
    """The dict a GGUF cache entry writes as config.json is read by transformers (ONNX Runtime GenAI's
    model builder, vLLM): its config classes validate field types, and query_pre_attn_scalar is an int."""
    from transformers import AutoConfig

    config = ModelConfig("gemma3_text", 100, 32, 64, 3, 2, 1, 16, 64, qk_norm=True, query_scale=16.0)
    data = config.to_hf_dict()
    hf = AutoConfig.for_model(data.pop("model_type"), **data)
    assert hf.query_pre_attn_scalar == 16 and type(data["query_pre_attn_scalar"]) is int


def test_llama3_inv_freq_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {**LLAMA3_ROPE, "rope_theta": 500000.0, "original_max_position_embeddings": 64}
    hf = LlamaConfig(hidden_size=256, num_attention_heads=2, rope_parameters=rope)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    ours = rope_inv_freq(config_from_hf(hf.to_dict(), "c").rope, 128)
    assert torch.equal(ours, expected)


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        (
            {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]},
            UnsupportedArchitectureError,
            "'gpt2'",
        ),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, ModelLoadError, "'yarn'"),
        ({"hidden_act": "gelu"}, ModelLoadError, "hidden_act 'gelu'"),
        ({"hidden_size": None}, ModelLoadError, "'hidden_size' is missing"),
        ({"num_hidden_layers": "2"}, ModelLoadError, "'num_hidden_layers' must be an integer"),
        ({"num_key_value_heads": 3}, ModelLoadError, "num_heads \\(4\\) must be a multiple"),
    ],
)
def test_bad_configs_are_refused_naming_the_field(overrides, error, match):
    with pytest.raises(error, match=match):
        config_from_hf({**TINY_RAW, **overrides}, "dir/config.json")


def test_generation_config_eos_ids_are_merged(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**TINY_RAW, "eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert read_hf_config(tmp_path).eos_token_ids == (2, 7)


def test_sharded_weights_are_read_through_the_index(tmp_path):
    save_file({"a": np.ones(2, np.float32)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": np.zeros(3, np.float32)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    tensors = read_hf_weights(tmp_path, torch.device("cpu"))
    assert sorted(tensors) == ["a", "b"] and tensors["b"].shape == (3,)


def test_missing_shard_and_duplicate_tensors_are_refused(tmp_path):
    save_file({"a": np.ones(2, np.float32)}, str(tmp_path / "s1.safetensors"))
    save_file({"a": np.ones(2, np.float32)}, str(tmp_path / "s2.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s3.safetensors"}}))
    with pytest.raises(ModelLoadError, match=r"s3\.safetensors: shard listed in"):
        weight_files(tmp_path)
    index.write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}))
    with pytest.raises(ModelLoadError, match=r"s2\.safetensors: tensor\(s\) \['a'\] also appear"):
        read_hf_weights(tmp_path, torch.device("cpu"))


def test_pickle_only_checkpoints_are_refused_without_unpickling(tmp_path, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("torch.load must never be called")

    monkeypatch.setattr(torch, "load", forbidden)
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(ModelLoadError, match="never unpickles"):
        weight_files(tmp_path)
    (tmp_path / "pytorch_model.bin").unlink()
    with pytest.raises(ModelLoadError, match=r"no model\.safetensors or model\.safetensors\.index\.json"):
        weight_files(tmp_path)


GEMMA_RAW = {
    **{k: v for k, v in TINY_RAW.items() if k != "tie_word_embeddings"},
    "model_type": "gemma2",
    "architectures": ["Gemma2ForCausalLM"],
    "hidden_act": None,
    "hidden_activation": "gelu_pytorch_tanh",
    "num_hidden_layers": 7,
    "sliding_window": 8,
}


def test_gemma_defaults_are_transformers_defaults():
    """Absent keys mean what Gemma2Config / Gemma3TextConfig make of them; a null soft-cap is off."""
    g2 = config_from_hf(GEMMA_RAW, "c")
    assert (g2.query_scale, g2.attn_softcap, g2.final_softcap, g2.local_rope) == (256.0, 50.0, 30.0, None)
    assert g2.windowed_layers == (0, 2, 4, 6) and g2.tie_word_embeddings  # every 2nd layer global
    off = config_from_hf({**GEMMA_RAW, "attn_logit_softcapping": None, "final_logit_softcapping": None}, "c")
    assert (off.attn_softcap, off.final_softcap) == (None, None)
    g3 = config_from_hf({**GEMMA_RAW, "model_type": "gemma3_text", "rope_theta": None}, "c")
    assert g3.windowed_layers == (0, 1, 2, 3, 4, 6) and g3.qk_norm  # every 6th layer global
    assert (g3.rope.theta, g3.local_rope.theta, g3.attn_softcap, g3.final_softcap) == (1e6, 1e4, None, None)
    pattern = config_from_hf({**GEMMA_RAW, "model_type": "gemma3_text", "sliding_window_pattern": 3}, "c")
    assert pattern.windowed_layers == (0, 1, 3, 4, 6)


def test_gemma3_rope_spellings_parse_the_same():
    """transformers 4.x (rope_theta + rope_scaling for global layers, rope_local_base_freq) and 5.x
    (rope_parameters keyed by layer type)."""
    v4 = {
        **GEMMA_RAW,
        "model_type": "gemma3_text",
        "rope_theta": 1e6,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "rope_local_base_freq": 1e4,
    }
    rope = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    v5 = {**GEMMA_RAW, "model_type": "gemma3_text", "rope_parameters": rope}
    v5.pop("rope_theta")
    a, b = config_from_hf(v4, "v4"), config_from_hf(v5, "v5")
    assert a == b
    assert a.rope == RopeConfig(1e6, "linear", 8.0) and a.local_rope == RopeConfig(1e4)


def test_a_long_gemma3_window_keeps_its_local_layers():
    """A window past the context hides no key, but Gemma 3's local layers still rotate with their own base:
    they stay marked. Gemma 2's layers differ only by the window, which is then dropped."""
    long = {**GEMMA_RAW, "sliding_window": 512}
    assert config_from_hf({**long, "model_type": "gemma3_text"}, "c").windowed_layers == (0, 1, 2, 3, 4, 6)
    assert config_from_hf(long, "c").windowed_layers == ()


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"model_type": "gemma3", "text_config": {}}, UnsupportedArchitectureError, "only the text model"),
        ({"architectures": ["Gemma3ForConditionalGeneration"]}, UnsupportedArchitectureError, "'gemma3'"),
        ({"use_bidirectional_attention": True}, ModelLoadError, "use_bidirectional_attention"),
        (
            {"model_type": "gemma3_text", "attn_logit_softcapping": 50.0},
            ModelLoadError,
            "not part of Gemma 3",
        ),
        ({"hidden_activation": "gelu"}, ModelLoadError, "hidden_act 'gelu' is not supported"),
        ({"query_pre_attn_scalar": -1}, ModelLoadError, "'query_pre_attn_scalar' must be a positive"),
        ({"layer_types": None, "sliding_window_pattern": 0}, ModelLoadError, "sliding_window_pattern must"),
        ({"model_type": "gemma3_text", "rope_scaling": {"rope_type": "yarn"}}, ModelLoadError, "'yarn'"),
    ],
)
def test_bad_gemma_configs_are_refused_naming_the_field(overrides, error, match):
    with pytest.raises(error, match=match):
        config_from_hf({**GEMMA_RAW, **overrides}, "dir/config.json")
