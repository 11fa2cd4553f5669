"""Tiny random-weight checkpoints of every supported family, loaded by pagedgen, against transformers.

HF directories are written by transformers itself (``save_pretrained``, safetensors); GGUF files by a
writer that follows llama.cpp's converter (tests/model/tiny_checkpoints.py), including its Q/K permutation.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pagedgen.models.model import Model
from tests.model.paged_runner import prompt_logits, stepwise_logits
from tests.model.tiny_checkpoints import (
    hf_config_dict,
    hf_state,
    llama_cpp_permute,
    llama_cpp_rope_factors,
    tiny_hf_model,
    write_gguf,
)

pytestmark = pytest.mark.model

TOL = 1e-4


def _prompt(vocab: int, length: int = 40, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _reference(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()  # [T, vocab]


@pytest.mark.parametrize("kind", ["llama", "llama3", "mistral", "qwen2", "qwen3"])
def test_tiny_hf_checkpoint_matches_transformers(kind, tmp_path):
    hf = tiny_hf_model(kind)
    hf.save_pretrained(tmp_path)
    model = Model(str(tmp_path), device="cpu")
    ids = _prompt(model.vocab_size, length=100)  # past llama3's original_max_position_embeddings (64)
    ref = _reference(hf, ids)
    assert ref.abs().max() > 0.5  # the weights are large enough for a wrong layer to show
    assert (prompt_logits(model, ids) - ref).abs().max().item() <= TOL
    assert (stepwise_logits(model, ids, prefill=37) - ref).abs().max().item() <= TOL


def test_tiny_family_traits_are_read_from_config(tmp_path):
    hf = tiny_hf_model("qwen3")
    hf.save_pretrained(tmp_path)
    config = Model(str(tmp_path), device="cpu").config
    assert (config.architecture, config.qk_norm, config.qkv_bias, config.head_dim) == (
        "qwen3",
        True,
        False,
        32,
    )


def test_sharded_checkpoint_matches_transformers(tmp_path):
    hf = tiny_hf_model("qwen2")
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (tmp_path / "model.safetensors").exists()
    model = Model(str(tmp_path), device="cpu")
    ids = _prompt(model.vocab_size, seed=3)
    assert (prompt_logits(model, ids) - _reference(hf, ids)).abs().max().item() <= TOL


@pytest.mark.parametrize(("arch", "kind"), [("llama", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3")])
def test_tiny_gguf_matches_transformers(arch, kind, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDGEN_CACHE_DIR", str(tmp_path / "cache"))
    hf = tiny_hf_model(kind, seed=5)
    state = hf_state(hf)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, arch, state, hf_config_dict(hf))
    if arch == "llama":  # the file really holds llama.cpp's permuted rows, which the reader must undo
        q = state["model.layers.0.self_attn.q_proj.weight"]
        assert not np.array_equal(llama_cpp_permute(q, 4, 4), q)
    model = Model(str(path), device="cpu")
    ids = _prompt(model.vocab_size, seed=7)
    assert (prompt_logits(model, ids) - _reference(hf, ids)).abs().max().item() <= TOL
    assert model.tokenizer.decode(model.tokenizer.encode("héllo wörld")) == "héllo wörld"
    assert model.eos_token_ids == (model.tokenizer.token_to_id("<|im_end|>"),)


def test_tiny_llama3_gguf_with_rope_freqs_matches_transformers(tmp_path, monkeypatch):
    """llama.cpp stores llama3 rope scaling as a ``rope_freqs`` tensor of divisors, not as metadata."""
    monkeypatch.setenv("PAGEDGEN_CACHE_DIR", str(tmp_path / "cache"))
    hf = tiny_hf_model("llama3", seed=9)
    config = hf_config_dict(hf)
    factors = llama_cpp_rope_factors(hf.config.rope_parameters, config["head_dim"])
    assert len(set(factors.tolist())) > 2  # all three regimes: kept, divided by 8, smoothed
    path = tmp_path / "llama3.gguf"
    write_gguf(path, "llama", hf_state(hf), config, rope_freqs=factors)
    model = Model(str(path), device="cpu")
    assert model.config.rope.rope_type == "freq_factors"
    ids = _prompt(model.vocab_size, length=100, seed=11)
    assert (prompt_logits(model, ids) - _reference(hf, ids)).abs().max().item() <= TOL
