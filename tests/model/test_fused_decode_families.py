"""The fused decode path on the q/k-norm families (Qwen3, Gemma 3) from GGUF files in mixed formats.

Tiny random-weight transformers models written as GGUF files the way a llama.cpp Q4_K_M file is stored: q/k
and gate/up in one format, v in another, o and down in K-quants, the embedding (Gemma 3: also the tied head)
in Q8_0. Each loads with native weights and decodes through the one-call path (kernels/decoder_layers.c):
bit for bit the per-layer path (same kernels, same order) over block tables and window rings, several
sequences at once; and, at every position, transformers' logits for the same (dequantised) weights within
1e-4. The tied Q8_0 head stays in its blocks: no float32 copy of the embedding is made.
"""

from __future__ import annotations

import gguf
import pytest
import torch

import pagedgen as pg
import pagedgen.ops.layers.decoder_layers as decoder_layers
import pagedgen.ops.matmul.quant_gemm as quant_gemm
from pagedgen.ops.kernels import native
from pagedgen.ops.matmul.qweight import QType, QuantizedWeight
from tests.model.hf_cases import ids_of
from tests.model.paged_runner import PagedRunner, PagedSequence, stepwise_logits
from tests.model.tiny_checkpoints import (
    formats_by_suffix,
    hf_config_dict,
    hf_state,
    tiny_hf_model,
    write_gemma_gguf,
    write_gguf,
)

pytestmark = [pytest.mark.model, pytest.mark.cpu]

TOL = 1e-4
Q = gguf.GGMLQuantizationType
# K-quant blocks are 256 wide: every matrix's in size is 256 (Qwen3's head_dim is 32: its o stays Q8_0)
WIDE = dict(hidden_size=256, intermediate_size=256, head_dim=64, initializer_range=0.05)
MIX = {
    "model.embed_tokens.weight": Q.Q8_0,
    "q_proj.weight": Q.Q5_0,
    "k_proj.weight": Q.Q5_0,
    "v_proj.weight": Q.Q8_0,
    "gate_proj.weight": Q.Q5_0,
    "up_proj.weight": Q.Q5_0,
    "down_proj.weight": Q.Q6_K,
    "lm_head.weight": Q.Q6_K,
}
O_PROJ = {"qwen3": Q.Q5_1, "gemma3": Q.Q4_K}  # Qwen3 o: in 128, not a K-quant multiple
FAMILIES = ["qwen3", "gemma3"]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDGEN_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module", params=FAMILIES)
def case(request, tmp_path_factory):
    if quant_gemm.quant_kernels() is None:
        pytest.skip(native.native_status().detail)
    kind = request.param
    path = tmp_path_factory.mktemp(kind) / f"{kind}-mixed.gguf"
    mix = {**MIX, "o_proj.weight": O_PROJ[kind]}
    if kind == "qwen3":
        hf = tiny_hf_model(kind, **WIDE)
        qtype = formats_by_suffix(mix, Q.Q8_0)
        write_gguf(path, "qwen3", hf_state(hf), hf_config_dict(hf), qtype=qtype, tokenizer=False)
    else:
        # llama.cpp's gemma3 file carries no query scale: its rule is the head size, so the HF config takes it
        hf = tiny_hf_model(kind, tie_word_embeddings=True, query_pre_attn_scalar=WIDE["head_dim"], **WIDE)
        qtype = formats_by_suffix(mix, Q.F32)
        write_gemma_gguf(path, hf, pattern=[True, False, True, True], local_base=1_000.0, qtype=qtype)
    cache = tmp_path_factory.mktemp(f"{kind}-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGEDGEN_CACHE_DIR", str(cache))
        model = pg.Model(str(path), device="cpu")
        dense = pg.Model(str(path), device="cpu", weights="float32")
    return kind, model, _with_weights_of(hf, dense)


def _with_weights_of(hf, dense):
    """transformers' model carrying the file's weights as pagedgen's float32 load dequantised them."""
    ours = dense.runtime.state_dict()
    theirs = hf.state_dict()
    wanted = {name: ours[name] for name in theirs if name in ours}
    assert set(theirs) - set(wanted) <= {"lm_head.weight"}  # tied: the embedding
    hf.load_state_dict(wanted, strict=False)
    return hf.eval()


def _reference(hf, ids) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_the_mixed_layers_take_the_fused_path(case):
    kind, model, _ = case
    runtime = model.runtime
    layer = runtime.model.layers[0]
    assert layer.self_attn.qkv is None and layer.self_attn.q_norm is not None  # q/k/v kept apart
    assert runtime.fused_decoder is not None
    assert runtime.fused_decoder._c_layers[0].qkv.num_segments == 3
    if kind == "gemma3":
        local = [c.local_rope for c in runtime.fused_decoder._c_layers]
        assert local == [1, 0, 1, 1] and runtime.config.local_rope is not None


def test_fused_decode_matches_transformers_at_every_position(case):
    kind, model, hf = case
    ids = ids_of(40)  # past Gemma 3's window of 8 many times
    before = decoder_layers.FUSED_STEPS.count
    got = stepwise_logits(model, ids, prefill=5)
    # every step fused: the all-logits prefill too (planned as five decodes, as draft rows are)
    assert decoder_layers.FUSED_STEPS.count - before == 1 + len(ids) - 5
    assert (got - _reference(hf, ids)).abs().max().item() <= TOL


def _run(model, fused: bool, prompts, ring_chunk: int | None, steps: int = 14):
    runtime = model.runtime
    kept = runtime.fused_decoder
    runtime.fused_decoder = kept if fused else None
    try:
        runner = PagedRunner(model, num_blocks=64, block_size=4, seed=3, ring_chunk=ring_chunk)
        seqs = [PagedSequence(tokens=[]) for _ in prompts]
        outputs = [runner.step(seqs, prompts)]
        for _ in range(steps):
            outputs.append(runner.step(seqs, [[t] for t in outputs[-1].argmax(-1).tolist()]))
        return outputs, runner.cache
    finally:
        runtime.fused_decoder = kept


@pytest.mark.parametrize("ring_chunk", [None, 8], ids=["block-tables", "rings"])
def test_fused_decode_is_the_per_layer_path_bit_for_bit(case, ring_chunk):
    _, model, _ = case
    prompts = [ids_of(n, seed=30 + n) for n in (3, 9, 6)]  # a ring (chunk 8, window 8) takes 9 at once
    before = decoder_layers.FUSED_STEPS.count
    fused_logits, fused_cache = _run(model, True, prompts, ring_chunk)
    assert decoder_layers.FUSED_STEPS.count - before == 14
    plain_logits, plain_cache = _run(model, False, prompts, ring_chunk)
    assert decoder_layers.FUSED_STEPS.count - before == 14  # the per-layer run fused nothing
    for got, expected in zip(fused_logits, plain_logits, strict=True):
        assert torch.equal(got, expected)
    fused_kv, plain_kv = fused_cache.keys + fused_cache.values, plain_cache.keys + plain_cache.values
    for got, expected in zip(fused_kv, plain_kv, strict=True):
        assert torch.equal(got, expected)


def test_the_head_and_embedding_stay_in_their_blocks(case, monkeypatch):
    """Gemma 3 ties its head to the Q8_0 embedding: one set of blocks serves the lookup (rows expanded on
    lookup) and the logits (the quant GEMM over the sampled rows); Qwen3's own head stays Q6_K. Nothing
    dequantises a whole matrix, and no float32 copy of either is held."""
    kind, model, _ = case
    runtime = model.runtime
    embedding = runtime.model.embed_tokens.weight
    assert isinstance(embedding, QuantizedWeight) and embedding.qtype is QType.Q8_0
    if kind == "gemma3":
        assert runtime.lm_head is None and runtime.head_weight is embedding
    else:
        assert runtime.head_weight.qtype is QType.Q6_K
    vocab, hidden = embedding.shape
    assert [p for p in (*runtime.parameters(), *runtime.buffers()) if p.numel() >= vocab * hidden] == []
    expanded = []
    dequantize = quant_gemm.dequantize

    def recorded(weight, rows=None):
        expanded.append(weight.shape[0] if rows is None else len(rows))
        return dequantize(weight, rows)

    monkeypatch.setattr(quant_gemm, "dequantize", recorded)
    stepwise_logits(model, ids_of(12), prefill=6)
    assert expanded == [6] + [1] * 6  # the looked-up rows only: the prefill's six, one per decode
