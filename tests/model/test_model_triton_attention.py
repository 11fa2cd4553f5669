"""Whole tiny-model forwards through the Triton attention kernels equal the default path.

``PAGEDGEN_TRITON_ATTENTION=1`` forces the kernels (here on the CPU, under Triton's interpreter, which
``tests/conftest.py`` turns on); ``0`` is the default CPU path (native decode kernel, SDPA prefill, torch
soft-capping). Llama: GQA 4/2. Gemma 2: sliding-window layers (through block tables and through rings),
soft-capped scores, a query scale apart from the head size.
"""

from __future__ import annotations

import pytest
import torch

from pagedgen.models.model import Model
from pagedgen.ops.mixers import attention, triton_attention
from pagedgen.ops.mixers.triton_attention import TRITON_ENV
from tests.model.paged_runner import (
    PagedRunner,
    PagedSequence,
    chunked_logits,
    prompt_logits,
    stepwise_logits,
)
from tests.model.tiny_checkpoints import tiny_hf_model

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(not triton_attention.triton_importable(), reason="triton is not installed"),
]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-4  # fp32 noise at this size (tests/model/test_model_tiny.py)


@pytest.fixture(scope="module", params=["llama", "gemma2"])
def model(request, tmp_path_factory) -> Model:
    hf = tiny_hf_model(request.param, tie_word_embeddings=True)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return Model(str(path), device=DEVICE)


def _prompt(vocab: int, length: int) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(1)).tolist()


def _mixed_steps(model: Model) -> torch.Tensor:
    """Two steps that mix a decode row, a first prefill and a prefill after a cached prefix."""
    runner = PagedRunner(model, num_blocks=32, block_size=8, seed=3)
    a, b, c = PagedSequence(tokens=[]), PagedSequence(tokens=[]), PagedSequence(tokens=[])
    ids = _prompt(model.vocab_size, 60)
    first = runner.step([a, b], [ids[:21], ids[21:30]], all_logits=True)
    second = runner.step([a, b, c], [ids[30:31], ids[31:45], ids[45:60]], all_logits=True)
    return torch.cat([first, second])


def _logits(model: Model) -> dict[str, torch.Tensor]:
    ids = _prompt(model.vocab_size, 36)
    out = {
        "prompt": prompt_logits(model, ids),
        "stepwise": stepwise_logits(model, ids, prefill=24),
        "mixed": _mixed_steps(model),
    }
    if model.kv_spec.window_layers:
        out["rings"] = chunked_logits(model, ids, chunk=5)
    return out


def test_a_model_forward_through_the_triton_kernels_equals_the_default_path(model, monkeypatch):
    calls = []
    launch = attention.triton_paged_attention
    monkeypatch.setattr(
        attention, "triton_paged_attention", lambda *a, **k: calls.append(1) or launch(*a, **k)
    )
    monkeypatch.setenv(TRITON_ENV, "0")
    expected = _logits(model)
    assert not calls
    monkeypatch.setenv(TRITON_ENV, "1")
    got = _logits(model)
    assert len(calls) >= 30  # every attention layer of every step
    assert got.keys() == expected.keys()
    for name, logits in got.items():
        assert logits.abs().max() > 0.1, name  # logits large enough for a wrong attention to show
        assert (logits - expected[name]).abs().max().item() <= TOL, name
