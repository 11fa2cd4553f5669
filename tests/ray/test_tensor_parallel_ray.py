"""Tensor parallelism with rank 1 a Ray actor in a placement group, on a local two-CPU cluster (this machine's
one node: Ray puts it on the host's own address, not loopback, whatever ``_node_ip_address`` says).

The model is the tiny random Qwen2 checkpoint of the family tests (two KV heads: one per rank). Two ranks
through Ray give the one-rank engine's greedy tokens; the placement group holds one bundle per rank, the
first on this node; a killed actor makes the engine unhealthy with an error naming the rank, never hung;
closing the engine leaves no actor and no placement group; a placement the cluster cannot make is refused
with the resources in the message.
"""

from __future__ import annotations

import pytest
import ray
import torch
from ray.util import placement_group_table

import pagedgen as pg
from pagedgen.parallel import ray_ranks
from pagedgen.parallel.plan import TensorParallelError
from pagedgen.parallel.runner import TensorParallelRunner
from pagedgen.server.replicas.launch import start_local_ray
from tests.helpers import drain, submit
from tests.model.tiny_checkpoints import tiny_hf_model

pytestmark = [pytest.mark.model, pytest.mark.cpu]

F = pg.EngineEventFlags
E = pg.EngineErrorCode
PROMPTS = ([3, 17, 99, 4, 250, 8, 61], [200, 5, 5, 7, 12], [40, 41, 42])


@pytest.fixture(scope="module")
def cluster():
    start_local_ray(num_cpus=2, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2")
    tiny_hf_model("qwen2", tie_word_embeddings=False).save_pretrained(path)
    return pg.Model(str(path), device="cpu")


def engine_config(world: int, launcher: str = "local") -> pg.EngineConfig:
    return pg.EngineConfig(
        max_batch_size=4,
        num_blocks=64,
        block_size=4,
        max_scheduled_tokens=32,
        tensor_parallel_size=world,
        tensor_parallel_launcher=launcher,
        debug_invariants=True,
        prefix_caching=False,
    )


def greedy(engine: pg.Engine, n: int) -> list[list[int]]:
    requests = [submit(engine, p, n, max_length=128, do_sample=False) for p in PROMPTS]
    events = drain(engine)
    out = [[e.token for e in events if e.request is r and e.flags & F.TOKEN] for r in requests]
    for request in requests:
        request.close()
    return out


def assert_removed(launcher: ray_ranks.RayLauncher, group_id: str) -> None:
    assert placement_group_table()[group_id]["state"] == "REMOVED"
    for name in launcher.actor_names:
        with pytest.raises(ValueError, match="Failed to look up actor"):
            ray.get_actor(name)


def test_bundles_and_devices_follow_the_ranks_device():
    # The CUDA choice is only computed here (no GPU on this machine): one GPU per bundle, each actor's cuda:0.
    assert ray_ranks.bundles(2, torch.device("cuda"), "10.0.0.5") == [
        {"CPU": 1.0, "GPU": 1.0, "node:10.0.0.5": ray_ranks.DRIVER_NODE_SHARE},
        {"CPU": 1.0, "GPU": 1.0},
    ]
    assert [ray_ranks.RayLauncher.worker_device(torch.device("cuda", 0), r) for r in (1, 2)] == ["cuda:0"] * 2
    assert ray_ranks.RayLauncher.worker_device(torch.device("cpu"), 1) == "cpu"


def test_two_ranks_through_ray_equal_one_rank_and_close_removes_them(cluster, model):
    one = pg.Engine(model, engine_config(1))
    expected = greedy(one, 16)
    one.close()
    assert all(len(tokens) == 16 for tokens in expected)
    engine = pg.Engine(model, engine_config(2, "ray"))
    launcher = engine.parts.runner.launcher
    (node,) = ray.nodes()
    assert isinstance(launcher, ray_ranks.RayLauncher) and launcher.host == node["NodeManagerAddress"]
    group_id = launcher.placement_group.id.hex()
    table = placement_group_table()[group_id]
    assert (table["state"], table["strategy"], len(table["bundles"])) == ("CREATED", "STRICT_PACK", 2)
    assert table["bundles"][0] == {"CPU": 1.0, f"node:{launcher.host}": ray_ranks.DRIVER_NODE_SHARE}
    assert table["bundles"][1] == {"CPU": 1.0}
    (name,) = launcher.actor_names
    assert ray.get_actor(name) is not None
    assert greedy(engine, 16) == expected
    assert engine.stats().healthy and engine.check_invariants() == []
    engine.close()
    assert_removed(launcher, group_id)


def test_a_killed_actor_makes_the_engine_unhealthy_not_hung(cluster, model):
    engine = pg.Engine(model, engine_config(2, "ray"))
    launcher = engine.parts.runner.launcher
    group_id = launcher.placement_group.id.hex()
    (worker,) = engine.parts.runner._workers
    request = submit(engine, PROMPTS[0], 8, max_length=128)
    engine.run(max_events=64)  # a step on both ranks
    ray.kill(worker.process.actor, no_restart=True)
    assert worker.process.wait_ended(600.0)  # the owner has seen the death
    events = list(engine.run(max_events=64))
    assert [(e.request, e.flags, e.error_code) for e in events] == [
        (request, F.TURN_FINISHED | F.FAILED, E.ENGINE_EXECUTION_FAILURE)
    ]
    assert not engine.stats().healthy
    with pytest.raises(pg.EngineError, match=r"tensor-parallel rank 1 \(Ray actor pagedgen-tp-"):
        request.begin_turn([1, 2, 3])
    request.close()
    engine.close()
    assert_removed(launcher, group_id)


def test_a_placement_the_cluster_cannot_make_is_refused(cluster, tmp_path, monkeypatch):
    # Three KV heads split over three ranks, whose three one-CPU bundles never fit in two CPUs.
    tiny_hf_model(
        "qwen2", tie_word_embeddings=False, hidden_size=96, num_attention_heads=6, num_key_value_heads=3
    ).save_pretrained(tmp_path)
    model = pg.Model(str(tmp_path), device="cpu")
    monkeypatch.setattr(ray_ranks, "PLACEMENT_TIMEOUT_S", 1.0)
    before = set(placement_group_table())
    with pytest.raises(TensorParallelError, match=r"could not place 3 bundles \{'CPU': 1.0\} .*available"):
        TensorParallelRunner(model, 3, 16, 4, launcher="ray")
    (group_id,) = set(placement_group_table()) - before
    assert placement_group_table()[group_id]["state"] == "REMOVED"
