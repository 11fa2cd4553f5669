"""Every way ``Model(...)`` refuses a checkpoint: the error type and a message naming file and problem."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch

from pagedgen.errors import ModelLoadError, UnsupportedArchitectureError
from pagedgen.models.model import Model
from tests.model.tiny_checkpoints import TINY_RAW, random_state, write_gguf, write_hf_dir


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDGEN_CACHE_DIR", str(tmp_path / "cache"))


def _hf(tmp_path, raw=None, state=None, name="ckpt"):
    raw = TINY_RAW if raw is None else raw
    return write_hf_dir(tmp_path / name, raw, random_state(TINY_RAW) if state is None else state)


def test_a_valid_tiny_checkpoint_loads(tmp_path):
    model = Model(str(_hf(tmp_path)), device="cpu")
    assert (model.vocab_size, model.max_context, model.kv_spec.num_layers, model.dtype) == (
        260,
        256,
        2,
        torch.float32,
    )
    assert model.name == "ckpt"
    assert all(not p.requires_grad and p.device.type == "cpu" for p in model.runtime.parameters())


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match=r"nowhere: model path not found"):
        Model(str(tmp_path / "nowhere"))


def test_missing_config_file(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"empty/config\.json: file not found"):
        Model(str(tmp_path / "empty"))


def test_corrupt_config_file(tmp_path):
    path = _hf(tmp_path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config\.json: not a valid JSON file"):
        Model(str(path))


def test_unknown_architecture_is_named(tmp_path):
    raw = {**TINY_RAW, "model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]}
    with pytest.raises(
        UnsupportedArchitectureError, match=r"config\.json: unsupported architecture 'gpt_neox'"
    ):
        Model(str(_hf(tmp_path, raw=raw)))


def test_unknown_gguf_architecture_is_named(tmp_path):
    path = tmp_path / "falcon.gguf"
    write_gguf(path, "falcon", {}, TINY_RAW, tokenizer=False)
    with pytest.raises(
        UnsupportedArchitectureError, match=r"falcon\.gguf: unsupported GGUF architecture 'falcon'"
    ):
        Model(str(path))


def test_unsupported_gguf_quant_type_is_named_and_nothing_is_cached(tmp_path):
    path = tmp_path / "iq4.gguf"  # IQ4_NL: not among llama.cpp's common recipes, so not supported
    writer = gguf.GGUFWriter(str(path), "llama")
    _add_tiny_metadata(writer)
    iq4 = gguf.GGMLQuantizationType.IQ4_NL
    writer.add_tensor(
        "blk.0.ffn_up.weight", np.zeros((96, 144), dtype=np.uint8), raw_dtype=iq4
    )  # 256 values/row: eight 18-byte blocks
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        ModelLoadError, match=r"iq4\.gguf: tensor 'blk\.0\.ffn_up\.weight' uses GGUF type IQ4_NL"
    ):
        Model(str(path))
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*"))


def _add_tiny_metadata(writer):
    writer.add_context_length(TINY_RAW["max_position_embeddings"])
    writer.add_embedding_length(TINY_RAW["hidden_size"])
    writer.add_feed_forward_length(TINY_RAW["intermediate_size"])
    writer.add_block_count(TINY_RAW["num_hidden_layers"])
    writer.add_head_count(TINY_RAW["num_attention_heads"])
    writer.add_head_count_kv(TINY_RAW["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(TINY_RAW["vocab_size"])


def test_truncated_gguf(tmp_path):
    path = tmp_path / "cut.gguf"
    write_gguf(path, "llama", random_state(TINY_RAW), TINY_RAW, tokenizer=False)
    path.write_bytes(path.read_bytes()[:-4096])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf: truncated or corrupt GGUF file"):
        Model(str(path))


def test_truncated_safetensors(tmp_path):
    path = _hf(tmp_path)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4096])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: truncated or corrupt safetensors file"):
        Model(str(path))


def test_missing_tensors_are_named(tmp_path):
    state = random_state(TINY_RAW)
    del state["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(
        ModelLoadError, match=r"missing 1 tensor\(s\): model\.layers\.1\.mlp\.down_proj\.weight"
    ):
        Model(str(_hf(tmp_path, state=state)))


def test_extra_tensors_are_named(tmp_path):
    state = random_state({**TINY_RAW, "num_hidden_layers": 3})
    with pytest.raises(ModelLoadError, match=r"tensor\(s\) the config does not describe: model\.layers\.2\."):
        Model(str(_hf(tmp_path, state=state)))


def test_vocab_mismatch(tmp_path):
    state = random_state({**TINY_RAW, "vocab_size": 250})
    with pytest.raises(
        ModelLoadError, match=r"vocab mismatch: the token embedding has 250 rows but .* vocab_size is 260"
    ):
        Model(str(_hf(tmp_path, state=state)))


def test_shape_mismatch(tmp_path):
    state = random_state(TINY_RAW)
    state["model.layers.0.mlp.up_proj.weight"] = np.zeros((95, 64), dtype=np.float32)
    with pytest.raises(
        ModelLoadError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight' has shape \(95, 64\)"
    ):
        Model(str(_hf(tmp_path, state=state)))


def test_tied_checkpoint_may_carry_a_redundant_head(tmp_path):
    raw = {**TINY_RAW, "tie_word_embeddings": True}
    state = random_state(TINY_RAW)  # includes lm_head.weight
    model = Model(str(_hf(tmp_path, raw=raw, state=state)), device="cpu")
    assert model.runtime.lm_head is None
    assert model.runtime.head_weight is model.runtime.model.embed_tokens.weight


def test_pickle_checkpoint_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load called"))
    path = tmp_path / "pickled"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(TINY_RAW))
    (path / "pytorch_model.bin").write_bytes(b"\x80\x04junk")
    with pytest.raises(ModelLoadError, match="never unpickles"):
        Model(str(path))


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "weights.txt").write_text("hello")
    with pytest.raises(ModelLoadError, match=r"weights\.txt: not a checkpoint directory or a \.gguf file"):
        Model(str(tmp_path / "weights.txt"))


def test_bad_dtype(tmp_path):
    with pytest.raises(ModelLoadError, match="dtype 'int8' is not supported"):
        Model(str(_hf(tmp_path)), dtype="int8")


def test_bfloat16_load_keeps_rope_tables_float32(tmp_path):
    model = Model(str(_hf(tmp_path)), dtype="bf16", device="cpu")
    assert model.kv_spec.dtype == torch.bfloat16
    assert model.runtime.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert model.runtime.model.rotary_emb.inv_freq.dtype == torch.float32
