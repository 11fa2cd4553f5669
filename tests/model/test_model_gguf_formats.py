"""GGUF files that mix llama.cpp's formats per tensor, as its recipes (Q4_K_M, Q5_K_M, ...) write them.

Every format of those recipes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K-Q6_K, F16, BF16) appears in one tiny
file, several inside one layer (q/k Q5_0 beside v Q8_0; gate Q4_0 beside up Q4_1), each kept as stored, and
the logits match transformers reading the same file: its GGUF loader (gguf-py's dequantiser) for Llama,
and for Qwen3 and Gemma 3 (whose tiny configs its GGUF loader misreads: Qwen3's head size, Gemma's query
scale) the HF model given the file's tensors as gguf-py dequantises them. Sizes are multiples of 256 so the
K-quants fit.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

import pagedgen as pg
from pagedgen.models.native_weights import WeightFormat
from pagedgen.ops.matmul.qweight import QType, QuantizedWeight
from tests.model.hf_cases import ids_of
from tests.model.paged_runner import prompt_logits, stepwise_logits
from tests.model.tiny_checkpoints import hf_config_dict, hf_state, tiny_hf_model, write_gemma_gguf, write_gguf

pytestmark = pytest.mark.model

Q = gguf.GGMLQuantizationType
TOL = 1e-4
SIZES = dict(
    hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64
)
# Per layer (by parity): each projection's format. Layer 0 mixes q/k and v, layer 1 gate and up.
LAYER_TYPES = (
    {"q_proj": Q.Q5_0, "k_proj": Q.Q5_0, "v_proj": Q.Q8_0, "o_proj": Q.Q4_K, "gate_proj": Q.Q5_1},
    {"q_proj": Q.Q3_K, "k_proj": Q.Q3_K, "v_proj": Q.Q3_K, "o_proj": Q.Q2_K, "gate_proj": Q.Q4_0},
)
UP_DOWN = ({"up_proj": Q.Q5_1, "down_proj": Q.Q6_K}, {"up_proj": Q.Q4_1, "down_proj": Q.Q5_K})
GLOBAL_TYPES = {
    "llama": {"model.embed_tokens.weight": Q.Q8_0, "lm_head.weight": Q.Q6_K},
    "qwen3": {"model.embed_tokens.weight": Q.BF16, "lm_head.weight": Q.F16},
    "gemma3": {"model.embed_tokens.weight": Q.Q8_0},  # tied: the head runs on the Q8_0 blocks
}


def type_of(kind: str):
    def choose(name: str):
        if name in GLOBAL_TYPES[kind]:
            return GLOBAL_TYPES[kind][name]
        layer, projection = int(name.split(".")[2]), name.split(".")[-2]
        return {**LAYER_TYPES[layer % 2], **UP_DOWN[layer % 2]}[projection]

    return choose


def hf_model(kind: str):
    if kind == "qwen3":  # tiny Qwen3 has 32-wide heads: 8 of them make o_proj's input 256
        return tiny_hf_model("qwen3", seed=3, **{**SIZES, "num_attention_heads": 8})
    if kind == "gemma3":  # llama.cpp's rules: every 6th layer global, queries scaled by the head size
        rope = {
            "full_attention": {"rope_type": "default", "rope_theta": 50_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        }
        extra = dict(num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=64, rope_parameters=rope)
        return tiny_hf_model("gemma3", seed=3, **SIZES, **extra, tie_word_embeddings=True)
    return tiny_hf_model(kind, seed=3, **SIZES)


def write_file(kind: str, hf, path) -> None:
    if kind == "gemma3":
        write_gemma_gguf(path, hf, qtype=type_of(kind))
    else:
        write_gguf(path, kind, hf_state(hf), hf_config_dict(hf), qtype=type_of(kind))


def file_values(path, kind: str, hf) -> dict[str, torch.Tensor]:
    """The file's tensors as gguf-py dequantises them, by HF name (Gemma's stored ``1 + norm`` undone)."""
    reader = gguf.GGUFReader(path)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[kind.upper()], hf.config.num_hidden_layers)
    by_gguf = {names.get_name(n, try_suffixes=(".weight", ".bias")): n for n in hf.state_dict()}
    values = {}
    for tensor in reader.tensors:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        name = by_gguf[tensor.name]
        if kind == "gemma3" and name.endswith("norm.weight"):
            array = array - np.float32(1.0)
        values[name] = torch.from_numpy(array.reshape(hf.state_dict()[name].shape).copy())
    return values


def reference(kind: str, hf, path):
    """transformers on the file: its GGUF loader (Llama) or the HF model given the file's values."""
    if kind != "llama":  # no Q/K permutation to undo in these architectures
        values = file_values(path, kind, hf)
        values.setdefault("lm_head.weight", values["model.embed_tokens.weight"])  # tied
        hf.load_state_dict(values)
        return hf
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3"])
def test_a_file_mixing_every_format_runs_as_stored_and_matches_transformers(kind, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDGEN_CACHE_DIR", str(tmp_path / "cache"))
    hf = hf_model(kind)
    path = tmp_path / f"{kind}-mixed.gguf"
    write_file(kind, hf, path)
    model = pg.Model(str(path), device="cpu")
    assert model.weights_format is WeightFormat.NATIVE
    stored = {t.name: gguf.GGMLQuantizationType(t.tensor_type).name for t in gguf.GGUFReader(path).tensors}
    runtime = model.runtime
    for i, layer in enumerate(runtime.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for module, gguf_part in (
            *((getattr(attn, n), n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")),
            *((getattr(mlp, n), n) for n in ("gate_proj", "up_proj", "down_proj")),
        ):
            expected = {**LAYER_TYPES[i % 2], **UP_DOWN[i % 2]}[gguf_part]
            assert isinstance(module.weight, QuantizedWeight) and module.weight.qtype is QType[expected.name]
        assert (attn.qkv is None) == (i % 2 == 0)  # q/k Q5_0 beside v Q8_0 stay separate GEMMs
        assert (mlp.gate_up is None) == (i % 2 == 1)  # gate Q4_0 beside up Q4_1 too
    head = runtime.head_weight
    assert isinstance(head, QuantizedWeight)
    assert head.qtype.name == stored["output.weight" if "output.weight" in stored else "token_embd.weight"]
    ids = ids_of(24, seed=4)
    with torch.no_grad():
        ref = reference(kind, hf, path)(torch.tensor([ids])).logits[0].float()
    assert ref.abs().max().item() > 0.1  # a model whose logits differ, so the bound below means something
    for logits in (prompt_logits(model, ids), stepwise_logits(model, ids, prefill=17)):
        assert (logits - ref).abs().max().item() <= TOL
