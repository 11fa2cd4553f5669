"""The embedded SmolLM2-135M-Instruct (fp32, CPU) against transformers reading the same GGUF file.

Parity runs on both weight formats: native (the file's Q4_1/Q8_0 blocks, expanded in the kernels) and
float32 (dequantised at load); both are the same model up to summation order.

Two oracles (docs/architecture.md, "How we know it is right"): transformers (logits and greedy tokens) and
alone equals batched (a request's logits are the same alone and
inside a packed step that mixes prefill and decode rows over shuffled physical blocks).
"""

from __future__ import annotations

import pytest
import torch

from pagedgen.models.model import Model
from pagedgen.models.native_weights import WeightFormat
from pagedgen.ops.kernels.native import native_status
from pagedgen.ops.matmul.qweight import QType, QuantizedWeight
from tests.model.paged_runner import PagedRunner, PagedSequence, greedy, prompt_logits

pytestmark = pytest.mark.model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Émile a écrit 3 lettres — 你好, 世界! 😀",
]

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in one sentence.",
    "List three primary colors.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Give me a short tip for sleeping better.",
    "Who wrote Romeo and Juliet?",
]


def _chat_ids(model: Model, text: str) -> list[int]:
    return model.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True)


def test_default_model_surface(default_model):
    m = default_model
    assert (m.name, m.vocab_size, m.max_context, m.dtype, m.device.type) == (
        "SmolLM2-135M-Instruct",
        49152,
        8192,
        torch.float32,
        "cpu",
    )
    assert (m.kv_spec.num_layers, m.kv_spec.num_kv_heads, m.kv_spec.head_dim) == (30, 3, 64)
    assert m.tokenizer.token_to_id("<|im_end|>") in m.eos_token_ids
    assert m.tokenizer is m.tokenizer  # cached


def test_the_default_load_keeps_the_files_blocks(default_model, default_model_float32):
    if not native_status().available:
        pytest.skip(native_status().detail)
    assert default_model.weights_format is WeightFormat.NATIVE
    layer = default_model.runtime.model.layers[7]
    for weight in (layer.self_attn.qkv.weight, layer.self_attn.o_proj.weight, layer.mlp.gate_up.weight):
        assert isinstance(weight, QuantizedWeight) and weight.qtype is QType.Q4_1
    head = default_model.runtime.head_weight  # tied: the token embedding
    assert isinstance(head, QuantizedWeight) and (head.qtype, head.shape) == (QType.Q8_0, (49152, 576))
    assert default_model_float32.weights_format is WeightFormat.FLOAT32
    assert default_model_float32.runtime.head_weight.dtype is torch.float32


def test_logits_match_transformers_at_every_position(default_model_each_format, hf_default_model):
    model = default_model_each_format
    for text in PROMPTS:
        ids = model.tokenizer.encode(text)
        with torch.no_grad():
            ref = hf_default_model(torch.tensor([ids])).logits[0].float()  # [T, vocab]
        ours = prompt_logits(model, ids)
        assert ours.shape == ref.shape
        assert (ours - ref).abs().max().item() <= 1e-3, text


def test_greedy_chat_matches_transformers_generate(default_model_each_format, hf_default_model):
    model = default_model_each_format
    eos = model.eos_token_ids
    for text in CHATS:
        ids = _chat_ids(model, text)
        with torch.no_grad():
            out = hf_default_model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=32,
                do_sample=False,
                pad_token_id=2,
            )
        expected = out[0, len(ids) :].tolist()
        if expected and expected[-1] in eos:
            expected = expected[:-1]  # transformers emits the EOS it stops on; our loop stops before it
        assert greedy(model, ids, 32, eos) == expected, text


def test_packed_step_matches_each_request_alone(default_model):
    prompts = [_chat_ids(default_model, text) for text in CHATS]
    alone = [prompt_logits(default_model, ids, seed=i)[-1] for i, ids in enumerate(prompts)]
    runner = PagedRunner(default_model, num_blocks=128, block_size=16, seed=42)
    seqs = [PagedSequence(tokens=[]) for _ in prompts]
    # Requests 0-3 already hold a cached prefix (one token short, 5 short, half, a block boundary), filled
    # by an earlier packed step; 4-7 arrive fresh. The step then mixes decode and prefill rows.
    cached = {0: len(prompts[0]) - 1, 1: len(prompts[1]) - 5, 2: len(prompts[2]) // 2, 3: 16}
    runner.step([seqs[i] for i in cached], [prompts[i][:n] for i, n in cached.items()])
    rest = [prompts[i][cached.get(i, 0) :] for i in range(len(prompts))]
    assert sorted({len(r) for r in rest})[0] == 1 and len({len(r) for r in rest}) > 4
    logits = runner.step(seqs, rest)
    assert logits.shape == (len(prompts), default_model.vocab_size)
    for i, row in enumerate(logits):
        assert (row - alone[i]).abs().max().item() <= 1e-4, f"request {i}"
        assert int(row.argmax()) == int(alone[i].argmax())
