"""The decoder state manifest: which decoder state each layer owns, described without naming a model family.

The engine and the cache decide their pools from this one structural description (groups of layers by kind
of state transition, and the sliding window) instead of asking which family a model is. Validation here is
structural; what one engine accepts is :meth:`StateManifest.dynamic_engine_problems`. The fields and the
legacy manifest: docs/cache.md, "The decoder state manifest".
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pagedgen.errors import StateManifestError


class StateKind(enum.Enum):
    PAGED_KV = "paged_kv"
    FIXED_CONV = "fixed_conv"
    FIXED_RECURRENT = "fixed_recurrent"


@dataclass(frozen=True, slots=True)
class StateGroup:
    """One group of logical layers sharing a kind of decoder state; ``name`` is optional and unique."""

    kind: StateKind
    layers: tuple[int, ...]
    name: str | None = None


@dataclass(frozen=True, slots=True)
class SlidingWindow:
    """Layers that attend to the last ``size`` positions only (the query's own included)."""

    size: int
    layers: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StateManifest:
    """A validated manifest for a decoder of ``num_layers`` layers (raises :class:`StateManifestError`).

    ``groups`` empty means the legacy dense paged-KV group over ``0 .. num_layers - 1``. ``source`` says
    where the manifest came from, so an error can name it.
    """

    num_layers: int
    groups: tuple[StateGroup, ...] = ()
    sliding_window: SlidingWindow | None = None
    source: str = "model config"

    def __post_init__(self) -> None:
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise StateManifestError(
                f"{self.source}: num_layers must be a positive int, got {self.num_layers!r}"
            )
        names: set[str] = set()
        seen: dict[StateKind, set[int]] = {}
        for index, group in enumerate(self.groups):
            where = f"{self.source}: state_groups[{index}] ({group.kind.value})"
            if group.name is not None:
                if group.name in names:
                    raise StateManifestError(f"{where}: duplicate group name {group.name!r}")
                names.add(group.name)
            if not group.layers:
                raise StateManifestError(f"{where}: a group needs at least one layer")
            self._check_layers(group.layers, where)
            owned = seen.setdefault(group.kind, set())
            twice = sorted(owned.intersection(group.layers))
            if twice:
                raise StateManifestError(
                    f"{where}: layers {twice} already belong to another {group.kind.value} group"
                )
            owned.update(group.layers)
        window = self.sliding_window
        if window is not None:
            where = f"{self.source}: sliding_window"
            if isinstance(window.size, bool) or not isinstance(window.size, int) or window.size < 1:
                raise StateManifestError(f"{where}: size must be a positive int, got {window.size!r}")
            if not window.layers:
                raise StateManifestError(f"{where}: names no layer (omit sliding_window instead)")
            self._check_layers(window.layers, where)
            outside = sorted(set(window.layers) - set(self.paged_layers))
            if outside:
                raise StateManifestError(
                    f"{where}: layers {outside} are windowed but belong to no paged_kv group; every "
                    "sliding-window layer must belong to the paged group"
                )

    def _check_layers(self, layers: Sequence[int], where: str) -> None:
        for layer in layers:
            if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
                raise StateManifestError(
                    f"{where}: layer {layer!r} is outside the decoder's layers 0..{self.num_layers - 1}"
                )
        if len(set(layers)) != len(layers):
            raise StateManifestError(f"{where}: repeated layer ids in {list(layers)}")

    # -- what the manifest says -----------------------------------------------------------------------

    @property
    def is_legacy(self) -> bool:
        """No explicit groups: one dense paged-KV group over every layer."""
        return not self.groups

    def groups_of(self, kind: StateKind) -> tuple[StateGroup, ...]:
        return tuple(g for g in self.groups if g.kind is kind)

    @property
    def paged_layers(self) -> tuple[int, ...]:
        """Layers that own paged K/V, ascending (every layer for the legacy manifest)."""
        if self.is_legacy:
            return tuple(range(self.num_layers))
        return tuple(sorted({layer for g in self.groups_of(StateKind.PAGED_KV) for layer in g.layers}))

    @property
    def window_layers(self) -> tuple[int, ...]:
        return () if self.sliding_window is None else tuple(sorted(self.sliding_window.layers))

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Paged layers that keep the whole sequence (not windowed)."""
        windowed = set(self.window_layers)
        return tuple(layer for layer in self.paged_layers if layer not in windowed)

    @property
    def window_size(self) -> int | None:
        return None if self.sliding_window is None else self.sliding_window.size

    @property
    def fixed_groups(self) -> tuple[StateGroup, ...]:
        return tuple(g for g in self.groups if g.kind is not StateKind.PAGED_KV)

    def dynamic_engine_problems(self) -> list[str]:
        """Why the dynamic engine cannot serve this manifest (empty when it can).

        The engine owns one shared paged pool, so it needs exactly one paged_kv group. Fixed conv / recurrent
        groups are served by the fixed-state pool; whether the model really keeps their state is checked
        against its tensors by the engine (:mod:`pagedgen.engine.cache_layout`).
        """
        problems = []
        paged = 1 if self.is_legacy else len(self.groups_of(StateKind.PAGED_KV))
        if paged != 1:
            problems.append(
                f"{self.source}: the engine needs exactly one paged_kv group, the manifest has {paged}"
            )
        return problems

    # -- parsing ----------------------------------------------------------------------------------------

    @classmethod
    def from_dict(
        cls,
        data: object,
        num_layers: int,
        source: str,
        default_window: SlidingWindow | None = None,
    ) -> StateManifest:
        """Parse ``{"state_groups": [...], "sliding_window": {...}}`` (the ``pagedgen.json`` override).

        ``state_groups`` entries are ``{"kind": ..., "layers": [...], "name": optional}``; ``sliding_window``
        is ``{"size": W, "layers": [...]}`` or ``null`` (no window). A key that is absent keeps what the
        config said (``default_window``; the legacy group). Unknown keys and kinds are refused.
        """
        if not isinstance(data, Mapping):
            raise StateManifestError(
                f"{source}: the manifest must be a JSON object, got {type(data).__name__}"
            )
        unknown = sorted(set(data) - {"state_groups", "sliding_window"})
        if unknown:
            raise StateManifestError(
                f"{source}: unknown manifest keys {unknown} (known: state_groups, sliding_window)"
            )
        groups = tuple(_parse_group(g, i, source) for i, g in enumerate(_list(data, "state_groups", source)))
        window = default_window
        if "sliding_window" in data:
            window = _parse_window(data["sliding_window"], source)
        return cls(num_layers, groups, window, source)


def _list(data: Mapping[str, object], key: str, source: str) -> list[object]:
    value = data.get(key, [])
    if not isinstance(value, list):
        raise StateManifestError(f"{source}: {key} must be a list, got {type(value).__name__}")
    return value


def _layer_ids(value: object, where: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise StateManifestError(f"{where}: layers must be a list of layer ids, got {value!r}")
    try:
        return tuple(operator.index(v) if not isinstance(v, bool) else _bad(v) for v in value)
    except TypeError:
        raise StateManifestError(f"{where}: layers must be integers, got {value!r}") from None


def _bad(value: object) -> int:
    raise TypeError(value)


def _parse_group(entry: object, index: int, source: str) -> StateGroup:
    where = f"{source}: state_groups[{index}]"
    if not isinstance(entry, Mapping):
        raise StateManifestError(f"{where}: must be an object, got {entry!r}")
    unknown = sorted(set(entry) - {"kind", "layers", "name"})
    if unknown:
        raise StateManifestError(f"{where}: unknown keys {unknown} (known: kind, layers, name)")
    kinds = [k.value for k in StateKind]
    if entry.get("kind") not in kinds:
        raise StateManifestError(f"{where}: unknown kind {entry.get('kind')!r} (known: {kinds})")
    name = entry.get("name")
    if name is not None and not isinstance(name, str):
        raise StateManifestError(f"{where}: name must be a string, got {name!r}")
    return StateGroup(StateKind(entry["kind"]), _layer_ids(entry.get("layers"), where), name)


def _parse_window(entry: object, source: str) -> SlidingWindow | None:
    where = f"{source}: sliding_window"
    if entry is None:
        return None
    if not isinstance(entry, Mapping):
        raise StateManifestError(f"{where}: must be an object or null, got {entry!r}")
    unknown = sorted(set(entry) - {"size", "layers"})
    if unknown:
        raise StateManifestError(f"{where}: unknown keys {unknown} (known: size, layers)")
    return SlidingWindow(entry.get("size"), _layer_ids(entry.get("layers"), where))
