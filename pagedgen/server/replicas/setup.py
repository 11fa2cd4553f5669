"""What every process of a replicated application needs to build its part: the model, the engine, the options.

The ingress and each replica run in their own Ray worker processes (possibly on other machines), so what they
receive must be small, picklable and complete: a :class:`ModelSource` names the model and each process reads
it itself (a replica loads the whole model, the ingress only its :class:`ModelCard`), and
:class:`ReplicaSetup` carries the engine configuration and server options exactly as ``pagedgen serve``
builds them for one process.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ray.serve.config import AutoscalingConfig

from pagedgen.engine.config import EngineConfig
from pagedgen.models.base import CausalLM
from pagedgen.models.chat_template import render_chat
from pagedgen.models.synthetic import SyntheticTokenizer
from pagedgen.server.app import ServerOptions

if TYPE_CHECKING:
    from pathlib import Path

    from pagedgen.llm import TextTokenizer
    from pagedgen.models.config import ModelConfig
    from pagedgen.models.tokenizer import Tokenizer

SYNTHETIC = "synthetic"  # the weightless synthetic model and its one-character codec (tests, dry runs)
ROUTING_MODES = ("affinity", "random")
DEFAULT_IMBALANCE = 8  # requests: a holder this much busier than the least-loaded replica is passed over


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A model each process loads for itself: ``default``, a checkpoint directory, a ``.gguf`` path, or
    ``synthetic`` (the synthetic model with ``vocab_size`` and its codec; with ``chat_template``, a Jinja
    chat template, the codec renders chats too, so a dry run can serve ``/v1/chat/completions``)."""

    name: str = "default"
    weights: str = "native"
    vocab_size: int = 257
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if self.chat_template is not None and self.name != SYNTHETIC:
            raise ValueError(
                f"ModelSource.chat_template is for the synthetic model (a real model brings its own), "
                f"got model {self.name!r}"
            )

    def load(self) -> tuple[CausalLM, Tokenizer | SyntheticTokenizer]:
        """The model and its tokenizer."""
        if self.name == SYNTHETIC:
            from pagedgen.models.synthetic import SyntheticModel

            if self.chat_template is None:
                return SyntheticModel(vocab_size=self.vocab_size), SyntheticTokenizer(self.vocab_size)
            tokenizer = SyntheticChatTokenizer(self.vocab_size, self.chat_template)
            return SyntheticModel(vocab_size=self.vocab_size), tokenizer
        from pagedgen.llm import tokenizer_for
        from pagedgen.models.model import Model

        model = Model(self.name, weights=self.weights)
        return model, tokenizer_for(model)

    def describe(self) -> ModelCard:
        """What the ingress needs of the model, read from its config and tokenizer files: no weights are
        read or built (a replica loads those with :meth:`load`)."""
        if self.name == SYNTHETIC:
            from pagedgen.models.synthetic import SyntheticModel

            model = SyntheticModel(vocab_size=self.vocab_size)  # weightless: nothing to skip
            tokenizer = (
                SyntheticTokenizer(self.vocab_size)
                if self.chat_template is None
                else SyntheticChatTokenizer(self.vocab_size, self.chat_template)
            )
            return ModelCard(model.vocab_size, model.max_context, tuple(model.eos_token_ids), tokenizer)
        return _describe_checkpoint(self.name)


@dataclass(frozen=True, eq=False)  # no slots: guidance caches its tokenizer under a weak reference to it
class ModelCard:
    """A model as the serving code sees it apart from the engine: its context length, vocabulary size,
    end-of-turn ids and tokenizer (with its chat template). The ingress serves the single server's app over
    this instead of a loaded model, so it holds no weights; the parameter checks that need the model
    (``GeneratorParams``, a structured-outputs constraint against the tokenizer) read only these four."""

    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...]
    tokenizer: TextTokenizer


@dataclass(frozen=True, slots=True)
class _CheckpointFiles:
    """What :class:`~pagedgen.models.tokenizer.Tokenizer` reads of a model: where its files are and its
    config (the EOS ids), without the model."""

    checkpoint_dir: Path
    config: ModelConfig


def _describe_checkpoint(name: str) -> ModelCard:
    """The card of a checkpoint, read with the functions :class:`~pagedgen.models.model.Model` reads its
    config, manifest and EOS ids with (the same context length, vocabulary and EOS ids), without its
    weights."""
    from pagedgen.models.checkpoint import resolve_checkpoint
    from pagedgen.models.checkpoint_manifest import read_config
    from pagedgen.models.tokenizer import Tokenizer, eos_token_ids

    checkpoint = resolve_checkpoint(name)
    config, _ = read_config(checkpoint.directory, checkpoint.source)
    tokenizer = Tokenizer(_CheckpointFiles(checkpoint.directory, config))
    return ModelCard(config.vocab_size, config.max_context, eos_token_ids(config, tokenizer), tokenizer)


class SyntheticChatTokenizer(SyntheticTokenizer):
    """The synthetic codec with a chat template, rendered the way a real tokenizer renders its own."""

    def __init__(self, vocab_size: int, chat_template: str):
        super().__init__(vocab_size)
        self._template = chat_template

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, object]],
        add_generation_prompt: bool = True,
        **variables: object,
    ) -> str:
        return render_chat(self._template, messages, add_generation_prompt, variables)


@dataclass(frozen=True, slots=True)
class ReplicaSetup:
    """One replicated application: ``num_replicas`` engines (or Serve's ``autoscaling_config``, which then
    decides the count and is passed to Serve as it is), each on ``replica_cpus`` CPUs.

    ``routing``: ``affinity`` sends a prompt to the replica that was sent its longest prefix of full blocks
    unless that replica has ``imbalance`` more requests in flight than the least-loaded one (then the power of
    two choices); ``random`` ignores the prompt (the baseline the affinity figures compare with)."""

    source: ModelSource = field(default_factory=ModelSource)
    engine: EngineConfig = field(default_factory=EngineConfig)
    options: ServerOptions = field(default_factory=ServerOptions)
    num_replicas: int = 2
    replica_cpus: float = 1.0
    autoscaling_config: AutoscalingConfig | None = None
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
        if self.autoscaling_config is not None and not isinstance(self.autoscaling_config, AutoscalingConfig):
            raise ValueError("ReplicaSetup.autoscaling_config must be Serve's AutoscalingConfig")

    @property
    def max_replicas(self) -> int:
        """The most replicas that may run at once (admission sizes the application's capacity by it)."""
        if self.autoscaling_config is None:
            return self.num_replicas
        return self.autoscaling_config.max_replicas


def parse_autoscaling(text: str | None) -> AutoscalingConfig | None:
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
    try:
        return AutoscalingConfig(**value)
    except Exception as exc:  # pydantic's ValidationError names the field
        raise ValueError(f"--autoscaling-config: {exc}") from exc
