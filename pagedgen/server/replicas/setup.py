"""What every process of a replicated application needs to build its part: the model, the engine, the options.

The ingress and each replica run in their own Ray worker processes (possibly on other machines), so what they
receive must be small, picklable and complete: a :class:`ModelSource` names the model and each process loads
it itself, and :class:`ReplicaSetup` carries the engine configuration and server options exactly as
``pagedgen serve`` builds them for one process.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pagedgen.engine.config import EngineConfig
from pagedgen.server.app import ServerOptions

SYNTHETIC = "synthetic"  # the weightless synthetic model and its one-character codec (tests, dry runs)
ROUTING_MODES = ("affinity", "random")
DEFAULT_IMBALANCE = 8  # requests: a holder this much busier than the least-loaded replica is passed over


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A model each process loads for itself: ``default``, a checkpoint directory, a ``.gguf`` path, or
    ``synthetic`` (the synthetic model with ``vocab_size`` and its codec)."""

    name: str = "default"
    weights: str = "native"
    vocab_size: int = 257

    def load(self) -> tuple[Any, Any]:
        """The model and its tokenizer."""
        if self.name == SYNTHETIC:
            from pagedgen.models.synthetic import SyntheticModel, SyntheticTokenizer

            return SyntheticModel(vocab_size=self.vocab_size), SyntheticTokenizer(self.vocab_size)
        from pagedgen.llm import tokenizer_for
        from pagedgen.models.model import Model

        model = Model(self.name, weights=self.weights)
        return model, tokenizer_for(model)


@dataclass(frozen=True, slots=True)
class ReplicaSetup:
    """One replicated application: ``num_replicas`` engines (or Serve's ``autoscaling_config``, a dict of
    its fields, which then decides the count), each on ``replica_cpus`` CPUs.

    ``routing``: ``affinity`` sends a prompt to the replica that was sent its longest prefix of full blocks
    unless that replica has ``imbalance`` more requests in flight than the least-loaded one (then the power of
    two choices); ``random`` ignores the prompt (the baseline the affinity figures compare with)."""

    source: ModelSource = field(default_factory=ModelSource)
    engine: EngineConfig = field(default_factory=EngineConfig)
    options: ServerOptions = field(default_factory=ServerOptions)
    num_replicas: int = 2
    replica_cpus: float = 1.0
    autoscaling_config: dict[str, Any] | None = None
    routing: str = "affinity"
    imbalance: int = DEFAULT_IMBALANCE

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"ReplicaSetup.num_replicas must be >= 1, got {self.num_replicas}")
        if not self.replica_cpus >= 0:
            raise ValueError(f"ReplicaSetup.replica_cpus must be >= 0, got {self.replica_cpus}")
        if self.routing not in ROUTING_MODES:
            raise ValueError(f"ReplicaSetup.routing must be one of {ROUTING_MODES}, got {self.routing!r}")
        if self.imbalance < 0:
            raise ValueError(f"ReplicaSetup.imbalance must be >= 0, got {self.imbalance}")
        if self.autoscaling_config is not None and not isinstance(self.autoscaling_config, dict):
            raise ValueError("ReplicaSetup.autoscaling_config must be a dict of Serve's autoscaling fields")

    @property
    def max_replicas(self) -> int:
        """The most replicas that may run at once (admission sizes the application's capacity by it)."""
        if self.autoscaling_config is None:
            return self.num_replicas
        return int(self.autoscaling_config.get("max_replicas", self.num_replicas))


def parse_autoscaling(text: str | None) -> dict[str, Any] | None:
    """``--autoscaling-config`` (a JSON object of Serve's ``AutoscalingConfig`` fields), checked by Serve's
    own model so a typo is an error naming it before anything starts."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--autoscaling-config is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError("--autoscaling-config must be a JSON object")
    from ray.serve.config import AutoscalingConfig

    try:
        AutoscalingConfig(**value)
    except Exception as exc:  # pydantic's ValidationError names the field
        raise ValueError(f"--autoscaling-config: {exc}") from exc
    return value
