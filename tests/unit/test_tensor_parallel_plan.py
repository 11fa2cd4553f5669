"""Tensor-parallel shard arithmetic: which heads and MLP channels each rank owns, at every boundary."""

from __future__ import annotations

import pytest
import torch

import pagedgen as pg
from pagedgen.errors import InvalidArgumentError
from pagedgen.parallel.comm import backend_for
from pagedgen.parallel.launch import LocalLauncher
from pagedgen.parallel.plan import RankShard, TensorParallelError, even_ranges, plan_shards


def test_even_ranges_put_the_remainder_first():
    assert even_ranges(3, 2) == [(0, 2), (2, 3)]
    assert even_ranges(4, 2) == [(0, 2), (2, 4)]
    assert even_ranges(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert even_ranges(5, 1) == [(0, 5)]


def test_the_default_models_sizes_split_by_kv_group_unevenly():
    # SmolLM2-135M: 9 query heads in 3 KV groups of 3, 1536 inner channels in Q4_1 blocks of 32.
    assert plan_shards(9, 3, 1536, 2, inner_unit=32) == [
        RankShard(0, (0, 6), (0, 2), (0, 768), True),
        RankShard(1, (6, 9), (2, 3), (768, 1536), False),
    ]


def test_divisible_kv_heads_split_evenly():
    shards = plan_shards(32, 8, 11008, 4)
    assert [s.q_heads for s in shards] == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert [s.kv_heads for s in shards] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [s.num_inner for s in shards] == [2752] * 4
    assert [s.adds_bias for s in shards] == [True, False, False, False]


def test_fewer_kv_heads_than_ranks_replicate_each_kv_head():
    # One KV head (multi-query attention) over 2 ranks: both hold it, each takes half its query heads.
    shards = plan_shards(8, 1, 64, 2)
    assert [(s.q_heads, s.kv_heads) for s in shards] == [((0, 4), (0, 1)), ((4, 8), (0, 1))]
    # Two KV heads over 4 ranks: each KV head on two ranks.
    shards = plan_shards(8, 2, 64, 4)
    assert [(s.q_heads, s.kv_heads) for s in shards] == [
        ((0, 2), (0, 1)),
        ((2, 4), (0, 1)),
        ((4, 6), (1, 2)),
        ((6, 8), (1, 2)),
    ]


def test_the_mlp_is_cut_on_block_boundaries():
    shards = plan_shards(4, 4, 768, 2, inner_unit=256)  # 3 K-quant blocks: 2 and 1
    assert [s.inner for s in shards] == [(0, 512), (512, 768)]


@pytest.mark.parametrize(
    "args, message",
    [
        ((9, 3, 1536, 6), "cannot split 3 KV heads"),  # 6 ranks: 3 query heads per group do not halve
        ((8, 2, 64, 3), "cannot split 2 KV heads"),  # 3 ranks: not a multiple of 2 KV heads
        ((4, 4, 96, 2, 64), "cannot split the MLP's 96 channels in blocks of 64"),
        ((4, 4, 256, 2, 256), "in blocks of 256"),  # one block cannot go to two ranks
        ((4, 4, 64, 0), "tensor_parallel_size must be >= 1"),
    ],
)
def test_sizes_that_do_not_split_are_refused_by_name(args, message):
    with pytest.raises(TensorParallelError, match=message):
        plan_shards(*args)


def test_engine_config_validates_the_size():
    assert pg.EngineConfig().tensor_parallel_size == 1
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InvalidArgumentError, match="tensor_parallel_size"):
            pg.EngineConfig(tensor_parallel_size=bad)


def test_engine_config_validates_the_launcher_and_placement():
    config = pg.EngineConfig()
    assert (config.tensor_parallel_launcher, config.tensor_parallel_placement) == ("local", "STRICT_PACK")
    config = pg.EngineConfig(tensor_parallel_launcher="ray", tensor_parallel_placement="SPREAD")
    assert (config.tensor_parallel_launcher, config.tensor_parallel_placement) == ("ray", "SPREAD")
    with pytest.raises(
        InvalidArgumentError, match="tensor_parallel_launcher must be one of local, ray, got 'mp'"
    ):
        pg.EngineConfig(tensor_parallel_launcher="mp")
    with pytest.raises(
        InvalidArgumentError, match="tensor_parallel_placement must be one of STRICT_PACK, PACK"
    ):
        pg.EngineConfig(tensor_parallel_placement="spread")


@pytest.mark.parametrize(
    ("device", "backend"),
    [("cpu", "gloo"), ("cuda", "nccl"), ("cuda:1", "nccl")],
    ids=["cpu", "cuda", "cuda1"],
)
def test_the_collective_backend_follows_the_device(device, backend):
    # Only the choice runs here (no GPU on this machine): a CUDA rank's group is NCCL, a CPU rank's gloo.
    assert backend_for(torch.device(device)) == backend


def test_a_device_without_a_backend_is_refused_by_name():
    with pytest.raises(TensorParallelError, match="cpu \\(gloo\\) or cuda \\(nccl\\) devices, not 'meta'"):
        backend_for(torch.device("meta"))


def test_each_launcher_names_a_rank_s_device():
    local = LocalLauncher()
    assert [local.worker_device(torch.device("cuda", 0), r) for r in (1, 2)] == ["cuda:1", "cuda:2"]
    assert local.worker_device(torch.device("cpu"), 1) == "cpu"
    assert local.host == "127.0.0.1"
