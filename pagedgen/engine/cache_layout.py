"""Which cache paths the engine builds for a model, chosen from its decoder state manifest.

The engine never asks which family a model is: it reads the manifest (``model.state_manifest``, else the
legacy one implied by ``model.kv_spec``) and decides which pools exist: one paged pool always, a window-ring
pool for sliding-window layers and a fixed-state pool for conv / recurrent groups on the dynamic path, and
whether prefix caching can apply (``prefix_off`` says why not); the ring and fixed-state bytes come off the
KV budget before the full pool is sized. The table of what is accepted, and why:
docs/cache.md, "What the engine accepts".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedgen.cache import FixedStatePool, WindowRingSpec
from pagedgen.core.decoder import DecoderModel
from pagedgen.core.fixed_state_spec import FixedStateSpec
from pagedgen.core.state_manifest import SlidingWindow, StateKind, StateManifest
from pagedgen.engine.config import EngineConfig
from pagedgen.errors import UnsupportedStateError


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """The engine's cache: the full pool's cost per block, the window-ring pool, the fixed-state pool."""

    bytes_per_block: int  # one block of the full-context pool (0 when every layer is windowed)
    window: WindowRingSpec | None  # the window-ring pool (dynamic path with sliding-window layers)
    window_bytes: int  # storage of the whole window pool, taken off the budget first
    chunk_size: int | None  # the scheduler's per-request query cap (C when there are rings)
    fixed: tuple[FixedStateSpec, ...] = ()  # the fixed-state tensors (empty: no fixed-state pool)
    fixed_bytes: int = 0  # storage of the fixed-state pool, taken off the budget first
    prefix_caching: bool = False  # share full blocks across requests (the config's wish, if possible)
    prefix_off: str | None = None  # why prefix caching is off although the config asked for it

    def with_prefix_caching(self, wanted: bool, dynamic: bool) -> CacheLayout:
        """This layout with prefix caching decided: on when ``wanted`` and the cache can restore a prefix."""
        reason = None
        if not dynamic:
            reason = "the static path has no paged cache to share"
        elif self.window is not None:
            reason = "sliding-window rings cannot be restored at a cached block boundary"
        elif self.fixed:
            reason = "fixed conv / recurrent state cannot be restored at a cached block boundary"
        return dataclasses.replace(
            self, prefix_caching=wanted and reason is None, prefix_off=reason if wanted else None
        )


def model_manifest(model: DecoderModel) -> StateManifest:
    """The model's manifest, or the legacy one its KV spec implies (a dense paged group, its window)."""
    manifest = model.state_manifest
    if manifest is not None:
        return manifest
    spec = model.kv_spec
    window = None if spec.window_size is None else SlidingWindow(spec.window_size, spec.window_layers)
    return StateManifest(spec.num_layers, (), window, f"{type(model).__name__}.kv_spec")


def fixed_state_specs(
    model: DecoderModel, manifest: StateManifest, dynamic: bool
) -> tuple[FixedStateSpec, ...]:
    """The model's fixed-state tensors, checked against the manifest's fixed groups.

    Raises :class:`UnsupportedStateError` on the static path with fixed groups, or when the groups and the
    model's tensors disagree (per kind, the same set of layers).
    """
    specs = tuple(model.fixed_state_specs)
    if manifest.fixed_groups and not dynamic:
        raise UnsupportedStateError(
            f"{manifest.source}: fixed conv / recurrent state needs dynamic_batching=True (the static path "
            "has no request-indexed fixed-state bindings)"
        )
    for kind in (StateKind.FIXED_CONV, StateKind.FIXED_RECURRENT):
        declared = sorted({layer for g in manifest.groups_of(kind) for layer in g.layers})
        kept = sorted({s.layer for s in specs if s.kind is kind})
        if declared != kept:
            raise UnsupportedStateError(
                f"{manifest.source}: the manifest's {kind.value} layers {declared} are not the layers the "
                f"model keeps {kind.value} state for ({kept}); every fixed group needs the model's state "
                "tensors and every state tensor a group"
            )
    return specs


def plan_cache_layout(model: DecoderModel, config: EngineConfig) -> CacheLayout:
    """Validate the model's manifest for this engine and choose its cache paths.

    Raises :class:`UnsupportedStateError` for a manifest this engine cannot serve (naming the groups) or one
    that disagrees with the model's KV geometry or fixed-state tensors.
    """
    manifest = model_manifest(model)
    problems = manifest.dynamic_engine_problems()
    if problems:
        raise UnsupportedStateError("cannot serve this model: " + "; ".join(problems))
    spec = model.kv_spec
    if (manifest.window_size, manifest.window_layers) != (
        spec.window_size,
        tuple(sorted(spec.window_layers)),
    ):
        raise UnsupportedStateError(
            f"{manifest.source}: sliding window {manifest.window_size} on layers "
            f"{list(manifest.window_layers)} disagrees with the model's KV spec "
            f"({spec.window_size} on {list(spec.window_layers)})"
        )
    fixed = fixed_state_specs(model, manifest, config.dynamic_batching)
    fixed_bytes = FixedStatePool.bytes_for(fixed, config.max_batch_size) if fixed else 0
    block_size = config.block_size
    if not (config.dynamic_batching and spec.window_layers):
        layout = CacheLayout(spec.bytes_per_block(block_size), None, 0, config.chunk_size, fixed, fixed_bytes)
        return layout.with_prefix_caching(config.prefix_caching, config.dynamic_batching)
    chunk = min(config.chunk_size or config.max_scheduled_tokens, config.max_scheduled_tokens)
    assert spec.window_size is not None
    window = WindowRingSpec.for_residents(spec.window_size, chunk, block_size, config.max_batch_size)
    window_bytes = window.num_blocks * spec.bytes_per_window_block(block_size)
    layout = CacheLayout(
        spec.bytes_per_full_block(block_size), window, window_bytes, chunk, fixed, fixed_bytes
    )
    return layout.with_prefix_caching(config.prefix_caching, config.dynamic_batching)
