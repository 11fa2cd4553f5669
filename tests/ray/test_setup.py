"""The replicated application's configuration, without a cluster: the YAML file, the builder, the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve.config import AutoscalingConfig
from ray.serve.schema import ServeDeploySchema

from pagedgen.cli import UsageError, build_parser, cmd_serve
from pagedgen.server.replicas.application import ApplicationArgs, builder
from pagedgen.server.replicas.setup import SYNTHETIC, ModelSource, ReplicaSetup, parse_autoscaling

ROOT = Path(__file__).resolve().parents[2]


def test_the_repository_s_serve_config_validates_and_builds():
    config = yaml.safe_load((ROOT / "deploy" / "serve.yaml").read_text())
    (app,) = ServeDeploySchema.model_validate(config).applications
    assert app.import_path == "pagedgen.server.replicas.application:builder"
    args = ApplicationArgs.model_validate(config["applications"][0]["args"])
    setup = args.setup()
    assert (setup.source, setup.num_replicas, setup.replica_cpus) == (ModelSource("default"), 2, 1.0)
    assert setup.engine.max_batch_size == 16 and setup.options.model_name == "default"
    assert builder(args) is not None


def test_serve_validates_the_yaml_args_into_the_builder_s_model():
    """Serve's own step of ``serve run`` / ``serve deploy``: the builder's annotation is our model."""
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    app = call_user_app_builder_with_args_if_necessary(builder, {"model": "default", "replicas": 3})
    assert app is not None
    with pytest.raises(ValueError, match="modle"):
        call_user_app_builder_with_args_if_necessary(builder, {"modle": "default"})


@pytest.mark.parametrize(
    ("args", "field"),
    [({"modle": "default"}, "modle"), ({"replicas": "two"}, "replicas"), ({"routing": 3}, "routing")],
)
def test_the_builder_s_arguments_name_an_unknown_key_or_a_bad_value(args, field):
    with pytest.raises(ValueError, match=field):
        ApplicationArgs.model_validate(args)


def test_the_arguments_carry_the_autoscaling_settings_and_the_synthetic_chat_template():
    args = ApplicationArgs.model_validate(
        {
            "model": SYNTHETIC,
            "chat_template": "{{ messages[0]['content'] }}",
            "autoscaling_config": {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8},
        }
    )
    setup = args.setup()
    assert setup.autoscaling_config.max_replicas == 4 and setup.max_replicas == 4
    assert setup.autoscaling_config.target_ongoing_requests == 8
    _model, tokenizer = setup.source.load()
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"
    with pytest.raises(ValueError, match="autoscaling_config"):
        ApplicationArgs.model_validate({"autoscaling_config": {"max_replicas": -2}})


def test_a_chat_template_is_for_the_synthetic_model_only():
    with pytest.raises(ValueError, match="chat_template is for the synthetic model"):
        ModelSource("default", chat_template="{{ x }}")


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
    scaled = ReplicaSetup(autoscaling_config=AutoscalingConfig(min_replicas=1, max_replicas=5))
    assert scaled.max_replicas == 5
    with pytest.raises(ValueError, match="must be Serve's AutoscalingConfig"):
        ReplicaSetup(autoscaling_config={"max_replicas": 5})


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
    parsed = parse_autoscaling('{"min_replicas": 1, "max_replicas": 3}')
    assert (parsed.min_replicas, parsed.max_replicas) == (1, 3)


def test_ray_options_without_replicas_are_refused():
    args = build_parser().parse_args(["serve", "--port", "0", "--ray-address", "auto"])
    with pytest.raises(UsageError, match="need --replicas N"):
        cmd_serve(args)
