"""Tensor parallelism across the Llama family's traits, on tiny random checkpoints: q/k/v biases (Qwen2,
their k/v slices follow the heads), per-head q/k norms with a head size unlike hidden / heads (Qwen3), a
sliding window (Mistral), each two ranks against one: logits within 1e-4 over a prefill and decode steps.
Other families are refused before any process starts, with an error naming the family.
"""

from __future__ import annotations

import pytest
import torch

import pagedgen as pg
from pagedgen.executor.inputs import SequenceChunk, pack_step
from pagedgen.executor.runner import ModelRunner
from pagedgen.parallel.plan import TensorParallelError
from pagedgen.parallel.runner import TensorParallelRunner
from tests.helpers import synthetic_model
from tests.model.tiny_checkpoints import tiny_hf_model

pytestmark = [pytest.mark.model, pytest.mark.cpu]

BLOCK = 4
NUM_BLOCKS = 32
PROMPTS = ([3, 17, 99, 4, 250, 8, 61], [200, 5, 5, 7, 12])


def tiny_model(kind: str, tmp_path_factory, **overrides) -> pg.Model:
    path = tmp_path_factory.mktemp(kind)
    tiny_hf_model(kind, tie_word_embeddings=False, **overrides).save_pretrained(path)
    return pg.Model(str(path), device="cpu")


def run_steps(runner, decode_tokens: list[list[int]]) -> torch.Tensor:
    """A prefill of both prompts (a logits row per token), then decode steps of the given tokens."""
    tables = [list(range(0, 8)), list(range(8, 16))]
    chunks = [SequenceChunk(p, 0, t, True) for p, t in zip(PROMPTS, tables, strict=True)]
    out = [runner.execute(pack_step(chunks, BLOCK))]
    lens = [len(p) for p in PROMPTS]
    for tokens in decode_tokens:
        chunks = [SequenceChunk([tok], n, t, False) for tok, n, t in zip(tokens, lens, tables, strict=True)]
        out.append(runner.execute(pack_step(chunks, BLOCK)))
        lens = [n + 1 for n in lens]
    return torch.cat(out)


@pytest.mark.parametrize(
    "kind, overrides",
    [("qwen2", {}), ("qwen3", {}), ("mistral", {"sliding_window": 6})],
    ids=["qwen2-bias", "qwen3-qk-norm", "mistral-window"],
)
def test_two_ranks_match_one_on_each_member(kind, overrides, tmp_path_factory):
    model = tiny_model(kind, tmp_path_factory, **overrides)
    decode = [[11, 40], [9, 77], [150, 2], [31, 31], [64, 128], [1, 2], [5, 6], [7, 8]]
    one = ModelRunner(model, NUM_BLOCKS, BLOCK, cuda_graphs=False)
    expected = run_steps(one, decode)
    two = TensorParallelRunner(model, 2, NUM_BLOCKS, BLOCK)
    try:
        assert tuple(two.kv_cache.keys[0].shape[2:]) == (1, model.config.head_dim)  # 1 of the 2 KV heads
        got = run_steps(two, decode)
    finally:
        two.release()
    assert got.shape == expected.shape == (len(PROMPTS[0]) + len(PROMPTS[1]) + 2 * len(decode), 260)
    assert (got - expected).abs().max().item() <= 1e-4


def test_other_families_are_refused_by_name(tmp_path_factory):
    model = tiny_model("gemma2", tmp_path_factory)
    with pytest.raises(TensorParallelError, match="this model's family is 'gemma2'"):
        pg.Engine(model, pg.EngineConfig(num_blocks=16, tensor_parallel_size=2))
    with pytest.raises(TensorParallelError, match="Llama family .* family is 'SyntheticModel'"):
        pg.Engine(synthetic_model(), pg.EngineConfig(num_blocks=16, tensor_parallel_size=2))
    pg.Engine(model, pg.EngineConfig(num_blocks=16, tensor_parallel_size=1)).close()  # one rank: any family
