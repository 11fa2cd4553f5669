"""The rotary tables are the rotate-half tables of transformers' formula, bit for bit.

``RotaryEmbedding.forward`` multiplies the positions by the frequencies repeated over both halves in one op
instead of concatenating the half table with itself (docs/performance.md, "Host cost at batch 1, second
pass"); each angle is the same float32 product either way, so cos and sin must give the same bits for every
rope type, head size, step length (one decode row to a prefill that torch splits over threads), dtype and
thread count.
"""

from __future__ import annotations

import pytest
import torch

from pagedgen.models.config import RopeConfig
from pagedgen.models.llama import RotaryEmbedding

ROPES = {
    "default": RopeConfig(theta=10000.0),
    "large-theta": RopeConfig(theta=1_000_000.0),
    "linear": RopeConfig(rope_type="linear", factor=4.0),
    "llama3": RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, original_max_position_embeddings=64),
    "freq_factors": RopeConfig(theta=500000.0, rope_type="freq_factors"),
}


def _concatenated_tables(rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype):
    """The formula as written before: the half table of angles, concatenated with itself, then cos/sin."""
    inv_freq = rotary.inv_freq if rotary.freq_factors is None else rotary.inv_freq / rotary.freq_factors
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.fixture
def threads(request):
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 100, 5000])
@pytest.mark.parametrize("head_dim", [16, 64, 72, 128])
@pytest.mark.parametrize("rope", sorted(ROPES))
def test_the_tables_are_the_concatenated_half_tables_bit_for_bit(rope, head_dim, tokens, dtype, threads):
    rotary = RotaryEmbedding(ROPES[rope], head_dim, torch.device("cpu"))
    gen = torch.Generator().manual_seed(head_dim + tokens)
    if rotary.freq_factors is not None:  # a loaded weight in GGUF Llama 3 files
        rotary.freq_factors = torch.nn.Parameter(1.0 + 7.0 * torch.rand(head_dim // 2, generator=gen))
    positions = torch.randint(0, 40_000, (tokens,), generator=gen)
    cos, sin = rotary(positions, dtype)
    want_cos, want_sin = _concatenated_tables(rotary, positions, dtype)
    assert cos.dtype == sin.dtype == dtype and cos.shape == (tokens, head_dim)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


def test_the_repeated_frequencies_follow_the_module_to_another_dtype_or_device():
    rotary = RotaryEmbedding(ROPES["default"], 64, torch.device("cpu")).to(torch.float64)
    assert rotary.inv_freq_twice.dtype == torch.float64
    assert torch.equal(rotary.inv_freq_twice, torch.cat((rotary.inv_freq, rotary.inv_freq)))
