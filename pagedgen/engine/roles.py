"""The roles the engine's parts fill, as Protocols: the step, the scheduler (each with a static and a dynamic
implementation) and, in :mod:`pagedgen.executor.runner` and :mod:`pagedgen.core.decoder`, the runner and the
model.

``Engine`` is written against these, not against one implementation, so the static path and the dynamic path
share its code and a test can hand in a spy. Structural typing: an implementation fills a role by having its
members (docs/architecture.md, "The engine's parts").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from pagedgen.cache import PagedCacheManager
from pagedgen.engine.request import RequestState
from pagedgen.engine.step import StepResult
from pagedgen.guidance.masks import MaskComputer


class EngineStep(Protocol):
    """One engine step (``DynamicStep``: a transaction; ``StaticStep``: the fixed batch)."""

    masker: MaskComputer  # the guidance mask worker (its stats are the engine's; closed with it)

    def run(self) -> StepResult:
        """Execute at most one step; never raises except for a planning MemoryError."""
        ...


class EngineScheduler(Protocol):
    """Request membership and capacity (``DynamicScheduler`` over the paged cache, ``StaticScheduler``)."""

    cache: PagedCacheManager | None  # the dynamic path's cache manager (None: the static batch owns blocks)
    chunk_size: int | None  # the per-request query cap (None: none)
    num_preemptions: int  # running requests sent back to the waiting queue
    num_yields: int  # idle residents that yielded their place

    def submit(self, state: RequestState) -> None: ...

    def withdraw(self, state: RequestState) -> None: ...

    def release(self, state: RequestState) -> None: ...

    def is_resident(self, state: RequestState) -> bool: ...

    def has_work(self) -> bool: ...

    @property
    def num_resident(self) -> int: ...

    def block_counts(self) -> tuple[int, int]: ...

    def window_block_counts(self) -> tuple[int, int]: ...

    def fixed_slot_counts(self) -> tuple[int, int]: ...

    def violations(self, states: Mapping[int, RequestState]) -> list[str]: ...

    def snapshot(self) -> dict[str, object]:
        """Committed membership and cache state as comparable values (a rolled-back step leaves it equal)."""
        ...
