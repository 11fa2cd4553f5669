"""GGUF reading: dequantisation per ggml type, llama.cpp names and Q/K permutation, config from metadata."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedgen.errors import ModelLoadError, UnsupportedArchitectureError
from pagedgen.models.config import ModelConfig
from pagedgen.models.gguf_reader import (
    FREQ_FACTORS_NAME,
    dequantize_weight,
    gguf_config,
    open_gguf,
    our_tensor_name,
    permute_qk,
    plan_weights,
    unpermute_qk,
)
from tests.model.tiny_checkpoints import (
    TINY_RAW,
    add_tensor,
    finish_gguf,
    gguf_name,
    llama_cpp_permute,
    write_gguf,
)

Q = gguf.GGMLQuantizationType
CONFIG = ModelConfig("llama", 260, 64, 96, 2, 4, 2, 16, 256)


def _write(path, tensors, arch="llama", metadata=None):
    """A GGUF with raw tensors ``{gguf_name: (array, qtype)}`` and ``{arch}.*`` metadata."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    for name, (array, qtype) in tensors.items():
        if qtype in (Q.F32, Q.F16) or array.dtype != np.uint8:
            add_tensor(writer, name, array, qtype)
        else:
            writer.add_tensor(name, array, raw_dtype=qtype)
    finish_gguf(writer)
    return path


def _read_one(path):
    file = open_gguf(path)
    (plan,) = plan_weights(file)
    return plan, dequantize_weight(file, plan, CONFIG)


# Worst absolute error of each type on N(0, 1) data: a sanity bound that the right tensor came back.
BOUNDS = {
    Q.F32: 0,
    Q.F16: 2e-3,
    Q.BF16: 2e-2,
    Q.Q8_0: 3e-2,
    Q.Q5_0: 0.25,
    Q.Q5_1: 0.2,
    Q.Q4_0: 0.5,
    Q.Q4_1: 0.4,
}


@pytest.mark.parametrize("qtype", list(BOUNDS), ids=lambda q: q.name)
def test_dequantize_each_supported_type(tmp_path, qtype):
    x = np.random.default_rng(0).standard_normal((8, 96)).astype(np.float32)
    plan, values = _read_one(_write(tmp_path / "t.gguf", {"blk.0.ffn_up.weight": (x, qtype)}))
    assert (plan.name, plan.shape, plan.ggml_type) == (
        "model.layers.0.mlp.up_proj.weight",
        (8, 96),
        qtype.name,
    )
    assert values.dtype == np.float32 and values.flags.c_contiguous and values.flags.writeable
    np.testing.assert_array_equal(values, gguf.quants.dequantize(gguf.quants.quantize(x, qtype), qtype))
    assert np.abs(values - x).max() <= BOUNDS[qtype]


# K-quant block layouts: bytes per 256 values and where its fp16 super-block scales sit.
K_QUANTS = {Q.Q4_K: (144, (0, 2)), Q.Q5_K: (176, (0, 2)), Q.Q6_K: (210, (208,))}
K_QUANTS |= {Q.Q2_K: (84, (80, 82)), Q.Q3_K: (110, (108,))}


@pytest.mark.parametrize("qtype", list(K_QUANTS), ids=lambda q: q.name)
def test_k_quants_match_transformers_dequantizer(tmp_path, qtype):
    """gguf has no K-quant quantiser; random blocks are checked against transformers' torch dequantiser."""
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    block_bytes, scale_offsets = K_QUANTS[qtype]
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, size=(4 * 2, block_bytes), dtype=np.uint8)  # 4 rows of 512 values
    for offset in scale_offsets:  # finite, small scales instead of random bit patterns
        blocks[:, offset : offset + 2] = (
            rng.uniform(1e-3, 1e-2, size=(8, 1)).astype(np.float16).view(np.uint8)
        )
    raw = blocks.reshape(4, 2 * block_bytes)
    _, values = _read_one(_write(tmp_path / "k.gguf", {"blk.0.ffn_up.weight": (raw, qtype)}))
    expected = hf_dequantize(torch.from_numpy(raw.reshape(-1).copy()), qtype.value).reshape(4, 512).numpy()
    assert values.shape == (4, 512)
    np.testing.assert_allclose(values, expected, rtol=1e-5, atol=1e-6)


def test_unsupported_type_is_refused_naming_it(tmp_path):
    raw = np.zeros((2, 36), dtype=np.uint8)  # four IQ4_NL blocks (not among llama.cpp's common recipes)
    path = _write(tmp_path / "iq4.gguf", {"blk.0.ffn_up.weight": (raw, Q.IQ4_NL)})
    with pytest.raises(ModelLoadError, match=r"'blk\.0\.ffn_up\.weight' uses GGUF type IQ4_NL"):
        plan_weights(open_gguf(path))


def test_unpermute_undoes_llama_cpp_permute():
    rng = np.random.default_rng(2)
    q, k = rng.standard_normal((4 * 16, 64)), rng.standard_normal((2 * 16, 64))
    q_bias = rng.standard_normal(4 * 16)
    assert not np.array_equal(llama_cpp_permute(q, 4, 4), q)
    np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(q, 4, 4), 4), q)
    np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(k, 4, 2), 2), k)
    np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(q_bias, 4, 4), 4), q_bias)
    np.testing.assert_array_equal(permute_qk(k, 2), llama_cpp_permute(k, 4, 2))


@pytest.mark.parametrize(("arch", "permuted"), [("llama", True), ("qwen2", False)])
def test_q_k_rows_come_back_in_hf_order(tmp_path, arch, permuted):
    """llama.cpp permutes Q/K rows for its llama arch only; reading restores the HF rows in both cases."""
    state = {
        "model.layers.0.self_attn.q_proj.weight": np.arange(64 * 8, dtype=np.float32).reshape(64, 8),
        "model.layers.0.self_attn.k_proj.weight": np.arange(32 * 8, dtype=np.float32).reshape(32, 8),
        "model.layers.0.self_attn.q_proj.bias": np.arange(64, dtype=np.float32),
    }
    path = tmp_path / "qk.gguf"
    write_gguf(path, arch, state, {**TINY_RAW, "hidden_size": 8}, tokenizer=False)
    file = open_gguf(path)
    stored = {t.name: np.array(t.data) for t in file.reader.tensors}
    assert (
        not np.array_equal(stored["blk.0.attn_q.weight"], state["model.layers.0.self_attn.q_proj.weight"])
    ) is permuted
    for plan in plan_weights(file):
        np.testing.assert_array_equal(dequantize_weight(file, plan, CONFIG), state[plan.name])


def test_every_llama_cpp_name_maps_to_the_hf_name():
    hf_names = [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        *(
            f"model.layers.12.{module}.{kind}"
            for module in (
                "input_layernorm",
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "self_attn.o_proj",
                "self_attn.q_norm",
                "self_attn.k_norm",
                "post_attention_layernorm",
                "mlp.gate_proj",
                "mlp.up_proj",
                "mlp.down_proj",
            )
            for kind in ("weight", "bias")
        ),
    ]
    for name in hf_names:
        assert our_tensor_name(gguf_name(name), "x.gguf") == name
    assert our_tensor_name("rope_freqs.weight", "x.gguf") == FREQ_FACTORS_NAME


@pytest.mark.parametrize("name", ["blk.0.attn_qkv.weight", "token_types.weight", "blk.x.attn_q.weight"])
def test_unknown_tensor_name_is_refused(name):
    with pytest.raises(ModelLoadError, match="unknown GGUF tensor"):
        our_tensor_name(name, "x.gguf")


def _meta(arch="llama", **extra):
    base = {
        f"{arch}.context_length": 512,
        f"{arch}.embedding_length": 64,
        f"{arch}.feed_forward_length": 96,
        f"{arch}.block_count": 2,
        f"{arch}.attention.head_count": 4,
        f"{arch}.attention.head_count_kv": 2,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{arch}.rope.freq_base": 500000.0,
        f"{arch}.vocab_size": 260,
    }
    return {**base, **extra}


def test_config_from_metadata(tmp_path):
    one = np.ones((260, 64), dtype=np.float32)
    tensors = {"token_embd.weight": (one, Q.F32), "blk.0.attn_q.bias": (np.ones(64, np.float32), Q.F32)}
    config = gguf_config(open_gguf(_write(tmp_path / "m.gguf", tensors, metadata=_meta())))
    assert config == ModelConfig(
        architecture="llama",
        vocab_size=260,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=config.rms_norm_eps,
        rope=config.rope,
        tie_word_embeddings=True,  # no output.weight
        qkv_bias=True,  # attn_q.bias present
    )
    assert (config.rope.rope_type, config.rope.theta) == ("default", 500000.0)
    assert config.rms_norm_eps == pytest.approx(1e-5)


def test_config_rope_variants(tmp_path):
    ff = {"rope_freqs.weight": (np.ones(8, dtype=np.float32), Q.F32)}
    with_factors = gguf_config(open_gguf(_write(tmp_path / "a.gguf", ff, metadata=_meta())))
    assert with_factors.rope.rope_type == "freq_factors"
    linear = _meta(**{"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0})
    config = gguf_config(open_gguf(_write(tmp_path / "b.gguf", {}, metadata=linear)))
    assert (config.rope.rope_type, config.rope.factor) == ("linear", 4.0)
    yarn = _meta(**{"llama.rope.scaling.type": "yarn"})
    with pytest.raises(ModelLoadError, match="rope scaling type 'yarn'"):
        gguf_config(open_gguf(_write(tmp_path / "c.gguf", {}, metadata=yarn)))


def test_unknown_architecture_is_named(tmp_path):
    path = _write(tmp_path / "f.gguf", {}, arch="falcon", metadata=_meta("falcon"))
    with pytest.raises(UnsupportedArchitectureError, match="'falcon'"):
        gguf_config(open_gguf(path))


def test_truncated_and_foreign_files_are_refused(tmp_path):
    x = np.ones((8, 64), dtype=np.float32)
    path = _write(tmp_path / "t.gguf", {"blk.0.ffn_up.weight": (x, Q.F32)}, metadata=_meta())
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 100])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf: truncated or corrupt GGUF file"):
        open_gguf(tmp_path / "cut.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"PK\x03\x04" + data[4:])
    with pytest.raises(ModelLoadError, match=r"junk\.gguf: not a GGUF file"):
        open_gguf(tmp_path / "junk.gguf")
    with pytest.raises(ModelLoadError, match=r"missing\.gguf: GGUF file not found"):
        open_gguf(tmp_path / "missing.gguf")


def test_lfm2_tensor_names_follow_llama_cpps_lfm2_table():
    names = {
        "token_embd_norm.weight": "model.embedding_norm.weight",
        "blk.2.shortconv.conv.weight": "model.layers.2.conv.conv.weight",
        "blk.2.shortconv.in_proj.weight": "model.layers.2.conv.in_proj.weight",
        "blk.1.attn_norm.weight": "model.layers.1.operator_norm.weight",
        "blk.1.attn_output.weight": "model.layers.1.self_attn.out_proj.weight",
        "blk.1.attn_q_norm.weight": "model.layers.1.self_attn.q_layernorm.weight",
        "blk.1.ffn_gate.weight": "model.layers.1.feed_forward.w1.weight",
        "blk.1.ffn_up.weight": "model.layers.1.feed_forward.w3.weight",
    }
    for gguf_tensor, ours in names.items():
        assert our_tensor_name(gguf_tensor, "x.gguf", "lfm2") == ours
    with pytest.raises(ModelLoadError, match="not a llama-family weight"):
        our_tensor_name("blk.2.shortconv.conv.weight", "x.gguf")
