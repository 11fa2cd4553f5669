"""The replicated application's configuration, without a cluster: the YAML file, the builder, the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from pagedgen.cli import UsageError, build_parser, cmd_serve
from pagedgen.server.replicas.application import builder
from pagedgen.server.replicas.setup import ReplicaSetup, parse_autoscaling

ROOT = Path(__file__).resolve().parents[2]


def test_the_repository_s_serve_config_validates_and_builds():
    config = yaml.safe_load((ROOT / "deploy" / "serve.yaml").read_text())
    (app,) = ServeDeploySchema.model_validate(config).applications
    assert app.import_path == "pagedgen.server.replicas.application:builder"
    assert builder(config["applications"][0]["args"]) is not None


def test_the_builder_names_an_unknown_argument():
    with pytest.raises(ValueError, match=r"unknown application argument\(s\) \['modle'\]"):
        builder({"modle": "default"})


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_replicas": 0}, "num_replicas must be >= 1, got 0"),
        ({"replica_cpus": -1.0}, "replica_cpus must be >= 0, got -1.0"),
        ({"routing": "sticky"}, "routing must be one of"),
        ({"imbalance": -1}, "imbalance must be >= 0, got -1"),
    ],
)
def test_setup_fields_are_checked(fields, message):
    with pytest.raises(ValueError, match=message):
        ReplicaSetup(**fields)


def test_max_replicas_follows_the_autoscaling_bound():
    assert ReplicaSetup(num_replicas=3).max_replicas == 3
    assert ReplicaSetup(autoscaling_config={"min_replicas": 1, "max_replicas": 5}).max_replicas == 5


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "is not JSON"),
        ("[1]", "must be a JSON object"),
        ('{"max_replicas": -2}', "--autoscaling-config: "),
    ],
)
def test_autoscaling_config_is_checked_by_serve_s_model(text, message):
    with pytest.raises(ValueError, match=message):
        parse_autoscaling(text)
    assert parse_autoscaling('{"min_replicas": 1, "max_replicas": 3}') == {
        "min_replicas": 1,
        "max_replicas": 3,
    }


def test_ray_options_without_replicas_are_refused():
    args = build_parser().parse_args(["serve", "--port", "0", "--ray-address", "auto"])
    with pytest.raises(UsageError, match="need --replicas N"):
        cmd_serve(args)
