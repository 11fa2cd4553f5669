"""pg.Model(..., weights=...): GGUF blocks and 16-bit safetensors kept as stored, the same model as float32.

A native load holds exactly the float32 load's weight values (its blocks dequantise to them bit for bit), so
its logits differ only by summation order. Without the native kernels, native falls back to float32, logged.
"""

from __future__ import annotations

import json
import logging

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import pagedgen.ops.matmul.quant_gemm as quant_gemm
from pagedgen.errors import ModelLoadError
from pagedgen.models.llama import Linear, _fuse_linears, _set_weight
from pagedgen.models.model import Model
from pagedgen.models.native_weights import WeightFormat
from pagedgen.ops.kernels import native
from pagedgen.ops.matmul import gemm
from pagedgen.ops.matmul.quant_gemm import dequantize
from pagedgen.ops.matmul.qweight import QType, QuantizedWeight
from tests.helpers.linear import PROMPT_IDS, all_logits, random_weight
from tests.model.tiny_checkpoints import TINY_RAW, random_state, write_gguf

pytestmark = pytest.mark.cpu  # weights kept as stored run in the native CPU kernels


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("PAGEDGEN_CACHE_DIR", str(root))
    return root


@pytest.fixture
def need_kernels():
    if quant_gemm.quant_kernels() is None:
        pytest.skip(native.native_status().detail)


def _gguf(tmp_path, qtype: gguf.GGMLQuantizationType):
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_gguf(path, "llama", random_state(TINY_RAW, seed=3), TINY_RAW, qtype=qtype, tokenizer=False)
    return path


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "F16"])
def test_a_gguf_file_runs_on_its_stored_blocks(tmp_path, need_kernels, qtype):
    path = _gguf(tmp_path, gguf.GGMLQuantizationType[qtype])
    ours, plain = Model(str(path), device="cpu"), Model(str(path), device="cpu", weights="float32")
    assert (ours.weights_format, plain.weights_format) == (WeightFormat.NATIVE, WeightFormat.FLOAT32)
    layer, plain_layer = ours.runtime.model.layers[0], plain.runtime.model.layers[0]
    for weight in (layer.self_attn.qkv.weight, layer.mlp.down_proj.weight, ours.runtime.head_weight):
        assert isinstance(weight, QuantizedWeight) and weight.qtype is QType[qtype]
    assert (
        layer.self_attn.k_proj.weight.data.data_ptr() > layer.self_attn.qkv.weight.data.data_ptr()
    )  # a view
    assert isinstance(ours.runtime.model.norm.weight, torch.Tensor)  # norms stay float32
    # The same values: llama.cpp's Q/K row permutation undone on the blocks, nothing re-quantised.
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        got = dequantize(getattr(layer.self_attn, name).weight)
        assert torch.equal(got, getattr(plain_layer.self_attn, name).weight), name
    got, expected = all_logits(ours, PROMPT_IDS), all_logits(plain, PROMPT_IDS)
    assert (got - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_half_safetensors_stay_16_bit(tmp_path, need_kernels, dtype):
    directory = tmp_path / "hf"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(TINY_RAW))
    state = {k: torch.from_numpy(v).to(dtype) for k, v in random_state(TINY_RAW, seed=2).items()}
    save_file(state, str(directory / "model.safetensors"))
    ours = Model(str(directory), device="cpu")
    plain = Model(str(directory), device="cpu", weights="float32")
    weight = ours.runtime.model.layers[1].mlp.down_proj.weight
    assert isinstance(weight, QuantizedWeight) and weight.nbytes == 2 * weight.shape[0] * weight.shape[1]
    assert torch.equal(dequantize(weight), plain.runtime.model.layers[1].mlp.down_proj.weight)
    got, expected = all_logits(ours, PROMPT_IDS), all_logits(plain, PROMPT_IDS)
    assert (got - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("off", ["disabled", "no compiler"])
def test_without_the_native_kernels_native_falls_back_to_float32_and_says_why(
    tmp_path, monkeypatch, caplog, off
):
    path = _gguf(tmp_path, gguf.GGMLQuantizationType.Q4_1)
    expected = all_logits(Model(str(path), device="cpu", weights="float32"), PROMPT_IDS)
    if off == "disabled":
        monkeypatch.setenv(native.DISABLE_ENV, "0")
    else:
        monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(native, "_loaded", [])  # restored afterwards: the library this process built
    monkeypatch.setattr(quant_gemm, "_kernels", [])
    monkeypatch.setattr(gemm, "_choices", {})  # backends chosen without the kernels stay in this test
    with caplog.at_level(logging.WARNING, logger="pagedgen"):
        model = Model(str(path), device="cpu")
    assert model.weights_format is WeightFormat.FLOAT32
    reason = (
        f"disabled by {native.DISABLE_ENV}" if off == "disabled" else "building the native kernels failed"
    )
    assert reason in model.weights_reason and "pagedgen loads float32 weights" in caplog.text
    assert isinstance(model.runtime.model.layers[0].self_attn.qkv.weight, torch.nn.Parameter)
    assert (
        all_logits(model, PROMPT_IDS) - expected
    ).abs().max().item() <= 1e-4  # pure-torch ops: another sum order


def test_native_needs_cpu_float32_activations(tmp_path, need_kernels):
    model = Model(str(_gguf(tmp_path, gguf.GGMLQuantizationType.Q8_0)), dtype="bf16", device="cpu")
    assert model.weights_format is WeightFormat.FLOAT32 and "CPU float32 only" in model.weights_reason
    assert model.runtime.model.layers[0].mlp.up_proj.weight.dtype is torch.bfloat16


def test_an_unknown_weights_argument_is_named(tmp_path):
    with pytest.raises(
        ModelLoadError, match=r"weights='int4' is not supported \(use 'native' or 'float32'\)"
    ):
        Model(str(_gguf(tmp_path, gguf.GGMLQuantizationType.Q8_0)), device="cpu", weights="int4")


def test_parts_stored_in_different_formats_are_left_unfused():
    """A Q4_K_M file keeps attn_v in Q6_K beside Q4_K q/k: they run as separate GEMMs."""
    parts = [Linear(256, 8, False, torch.float32) for _ in range(3)]
    for part, qtype in zip(parts, (QType.Q4_K, QType.Q4_K, QType.Q6_K), strict=True):
        _set_weight(part, random_weight(qtype, 8, 256))
    assert _fuse_linears(parts) is None
    _set_weight(parts[2], random_weight(QType.Q4_K, 8, 256, seed=1))
    fused = _fuse_linears(parts)
    assert fused.weight.shape == (24, 256) and np.shares_memory(
        parts[2].weight.data.numpy(), fused.weight.data.numpy()
    )


# llama.cpp's Q4_K_M-style mix on a tiny Llama (K-quants need 256-wide inputs): q/k Q5_0 beside v Q8_0 in
# layer 0 (three GEMMs), one format for q/k/v in layer 1 (one fused GEMM), gate/up Q5_1 fused.
MIXED_SIZES = dict(TINY_RAW, hidden_size=256, intermediate_size=512, head_dim=64)
MIXED_TYPES = {
    "model.embed_tokens.weight": "Q8_0",
    "lm_head.weight": "Q6_K",
    "self_attn.q_proj.weight": ("Q5_0", "Q3_K"),
    "self_attn.k_proj.weight": ("Q5_0", "Q3_K"),
    "self_attn.v_proj.weight": ("Q8_0", "Q3_K"),
    "self_attn.o_proj.weight": ("Q4_K", "Q2_K"),
    "mlp.gate_proj.weight": ("Q5_1", "Q4_0"),
    "mlp.up_proj.weight": ("Q5_1", "Q4_0"),
    "mlp.down_proj.weight": ("Q6_K", "Q5_K"),
}


def _mixed_type(name: str):
    if name in MIXED_TYPES:
        return gguf.GGMLQuantizationType[MIXED_TYPES[name]]
    layer, suffix = int(name.split(".")[2]), ".".join(name.split(".")[3:])
    return gguf.GGMLQuantizationType[MIXED_TYPES[suffix][layer % 2]]


def _reachable(module: torch.nn.Module) -> tuple[dict[str, QuantizedWeight], dict[str, torch.Tensor]]:
    """Every stored-format weight and every float tensor the runtime holds (parameters, buffers and plain
    attributes), by dotted name."""
    quantized, floats = {}, {}
    for prefix, sub in module.named_modules():
        for attr, value in {**vars(sub), **sub._parameters, **sub._buffers}.items():
            name = f"{prefix}.{attr}" if prefix else attr
            if isinstance(value, QuantizedWeight):
                quantized[name] = value
            elif isinstance(value, torch.Tensor) and value.is_floating_point():
                floats[name] = value
    return quantized, floats


def _unique_bytes(spans: list[tuple[int, int]]) -> int:
    """Bytes covered by ``(start, end)`` spans, overlaps counted once (a fused weight and its parts)."""
    total, reach = 0, 0
    for start, end in sorted(spans):
        total += max(0, end - max(start, reach))
        reach = max(reach, end)
    return total


def test_a_mixed_file_keeps_every_quantized_tensor_as_its_bytes_and_no_float32_copy(tmp_path, need_kernels):
    path = tmp_path / "mixed.gguf"
    write_gguf(
        path, "llama", random_state(MIXED_SIZES, seed=4), MIXED_SIZES, qtype=_mixed_type, tokenizer=False
    )
    tensors = gguf.GGUFReader(path).tensors
    quantized_in_file = sum(int(t.n_bytes) for t in tensors if t.tensor_type != gguf.GGMLQuantizationType.F32)
    float_in_file = {t.name for t in tensors if t.tensor_type == gguf.GGMLQuantizationType.F32}
    model = Model(str(path), device="cpu")
    quantized, floats = _reachable(model.runtime)
    spans = [(w.data.data_ptr(), w.data.data_ptr() + w.nbytes) for w in quantized.values()]
    assert _unique_bytes(spans) == quantized_in_file == 884_104  # each block once, nothing else
    assert len({w.data.untyped_storage().data_ptr() for w in quantized.values()}) == 1  # one file mapping
    # The only float32 tensors are the file's F32 ones (norms) and the rotary frequencies computed at build
    # (the half table and the same repeated over both halves).
    rotary = ("rotary_emb.inv_freq", "rotary_emb.inv_freq_twice")
    persistent = {name for name in floats if not name.endswith(rotary)}
    assert len(persistent) == len(float_in_file) == 5
    assert sum(floats[n].numel() for n in persistent) == sum(
        int(t.n_elements) for t in tensors if t.name in float_in_file
    )
    layers = model.runtime.model.layers
    assert layers[0].self_attn.qkv is None and layers[1].self_attn.qkv is not None  # formats differ / agree
    fused = layers[1].self_attn.qkv.weight
    assert fused.data.data_ptr() == layers[1].self_attn.q_proj.weight.data.data_ptr()  # a view, not a copy
    assert layers[0].mlp.gate_up.weight.qtype is QType.Q5_1
    plain = Model(str(path), device="cpu", weights="float32")
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):  # the Q/K permutation undone on the blocks
        for i in (0, 1):
            got = dequantize(getattr(layers[i].self_attn, name).weight)
            assert torch.equal(got, getattr(plain.runtime.model.layers[i].self_attn, name).weight), (i, name)
    got, expected = all_logits(model, PROMPT_IDS), all_logits(plain, PROMPT_IDS)
    assert (got - expected).abs().max().item() <= 1e-4
