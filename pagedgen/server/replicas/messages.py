"""What crosses from the ingress to a replica: small frozen records (pickled by Ray)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedgen.llm import SamplingParams
from pagedgen.server.worker import EngineSnapshot, Keep


@dataclass(frozen=True, slots=True)
class ReplicaJob:
    """One turn for a replica's engine. ``waited_s``: how long it has been since the ingress received it
    (clocks differ across machines, so the replica dates the arrival on its own clock)."""

    prompt_ids: tuple[int, ...]
    params: SamplingParams
    waited_s: float
    tag: str  # the HTTP request id, for log lines
    keep: Keep | None = None  # keep the Request open for a follow-up, or continue a kept one


@dataclass(frozen=True, slots=True)
class ReplicaTarget:
    """A call meant for one replica (``replica`` its unique id), or for any when None."""

    replica: str | None = None


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    """A replica's published counters and its own metrics exposition."""

    replica: str
    snapshot: EngineSnapshot
    metrics: bytes
    healthy: bool
