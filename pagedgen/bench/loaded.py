"""What a bench run loads and hands its modules: the model, the tokenizer its workloads encode with, the
checkpoint directory the peer systems read, and the float32-weights reference.

Types only, so every bench module names the same ones without importing the model code at start-up (the
model modules are imported under ``TYPE_CHECKING``; ``pagedgen bench --help`` stays quick).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol, TypeAlias

if TYPE_CHECKING:
    from pagedgen.models.model import Model
    from pagedgen.models.synthetic import SyntheticModel

# A loaded ``pg.Model``, or the weightless synthetic model (``--model synthetic``).
BenchModel: TypeAlias = "Model | SyntheticModel"


class BenchTokenizer(Protocol):
    """What the workloads call on a tokenizer: ``pg.Tokenizer``, the synthetic model's, or the byte tokenizer
    of a random-weights checkpoint without one (:class:`pagedgen.bench.random_weights.ByteTokenizer`)."""

    def encode(self, text: str, /) -> list[int]: ...


class LoadedModel(NamedTuple):
    """The model a throughput run measures, as the bench loaded it."""

    model: BenchModel
    tokenizer: BenchTokenizer
    checkpoint: Path | None  # what the baselines load; None for the synthetic model
    reference: Model | None  # the same checkpoint on float32 weights, when ``model`` keeps its own
