"""A checkpoint's decoder state manifest: derived from its config, or overridden by ``pagedgen.json``.

The manifest is the truth the runtime follows (its windowed layers are the ones masked and kept in rings),
so it is derived once from the config and may be replaced beside the checkpoint; what the engine can serve
is decided separately (:mod:`pagedgen.engine.cache_layout`). The derivation and the override's format:
docs/cache.md, "A checkpoint's manifest".
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pagedgen.core.state_manifest import SlidingWindow, StateGroup, StateKind, StateManifest
from pagedgen.errors import ModelLoadError, StateManifestError
from pagedgen.models.config import ModelConfig
from pagedgen.models.hf_loader import read_hf_config, read_json

OVERRIDE_FILE = "pagedgen.json"


def derived_manifest(config: ModelConfig, source: str = "model config") -> StateManifest:
    """The manifest the config implies: the legacy paged group and the config's sliding window, or, for a
    config with fixed-state layers (LFM2, Bamba), a paged group over the attention layers, a fixed_conv group
    over the layers that keep a convolution window and a fixed_recurrent group over those that keep a
    recurrent state (when any)."""
    window = None
    if config.sliding_window is not None:
        window = SlidingWindow(config.sliding_window, config.windowed_layers)
    groups: tuple[StateGroup, ...] = ()
    if config.conv_state_layers:
        groups = (
            StateGroup(StateKind.PAGED_KV, config.attention_layers, "attention"),
            StateGroup(StateKind.FIXED_CONV, config.conv_state_layers, "conv"),
        )
    if config.recurrent_state_layers:
        groups += (StateGroup(StateKind.FIXED_RECURRENT, config.recurrent_state_layers, "recurrent"),)
    return StateManifest(config.num_layers, groups, window, source)


def override_path(source: Path) -> Path:
    """Where the override for a checkpoint lives: ``dir/pagedgen.json``, or ``model.gguf.pagedgen.json``."""
    if source.is_dir():
        return source / OVERRIDE_FILE
    return source.with_name(source.name + "." + OVERRIDE_FILE)


def load_manifest(source: Path, config: ModelConfig) -> StateManifest:
    """The checkpoint's manifest: the override file's when there is one, else the derived one.

    Raises :class:`StateManifestError` naming the file and the problem.
    """
    derived = derived_manifest(config)
    path = override_path(source)
    if not path.is_file():
        return derived
    try:
        data = read_json(path)
    except ModelLoadError as exc:
        raise StateManifestError(str(exc)) from exc
    unknown = sorted(set(data) - {"decoder"})
    if unknown or not isinstance(data.get("decoder"), dict):
        raise StateManifestError(f'{path}: expected {{"decoder": {{...}}}}, got keys {sorted(data)}')
    return StateManifest.from_dict(data["decoder"], config.num_layers, str(path), derived.sliding_window)


def read_config(directory: Path, source: Path) -> tuple[ModelConfig, StateManifest]:
    """A checkpoint's config with its manifest applied, and the manifest: ``directory`` holds the HF
    files, ``source`` is what the caller named (a directory or a ``.gguf`` path; its override file sits
    beside it). The loaded model and the ingress's card (which reads no weights) both read it here, so
    they agree on the context length and vocabulary."""
    config = read_hf_config(directory)
    manifest = load_manifest(source, config)
    return apply_manifest(config, manifest), manifest


def apply_manifest(config: ModelConfig, manifest: StateManifest) -> ModelConfig:
    """``config`` with the manifest's sliding window; refuses a manifest that leaves an attention layer
    without K/V, gives K/V to a convolution or Mamba layer, or moves a convolution window out of fixed_conv
    or a recurrent state out of fixed_recurrent.
    """
    attention, conv = set(config.attention_layers), set(config.conv_state_layers)
    paged = set(manifest.paged_layers)
    missing = sorted(attention - paged)
    if missing:
        raise StateManifestError(
            f"{manifest.source}: layers {missing} attend but belong to no paged_kv group "
            f"(this {config.architecture} runtime keeps paged K/V in every attention layer)"
        )
    if paged & conv:
        raise StateManifestError(
            f"{manifest.source}: layers {sorted(paged & conv)} are convolution layers of this "
            f"{config.architecture} runtime; they keep no paged K/V"
        )
    for kind, layers, what in (
        (StateKind.FIXED_CONV, conv, "convolution"),
        (StateKind.FIXED_RECURRENT, set(config.recurrent_state_layers), "recurrent"),
    ):
        owned = {layer for g in manifest.groups_of(kind) for layer in g.layers}
        if layers - owned:
            raise StateManifestError(
                f"{manifest.source}: {what} layers {sorted(layers - owned)} belong to no {kind.value} group"
            )
    layers = manifest.window_layers
    if config.local_rope is not None and tuple(layers) != config.windowed_layers:
        raise StateManifestError(
            f"{manifest.source}: sliding-window layers {list(layers)} differ from the config's "
            f"{list(config.windowed_layers)}; this {config.architecture} runtime also rotates those layers "
            "with their own RoPE, so a manifest cannot move them"
        )
    if layers and conv:
        raise StateManifestError(
            f"{manifest.source}: this {config.architecture} runtime has no sliding-window attention "
            f"(layers {list(layers)})"
        )
    return dataclasses.replace(
        config,
        sliding_window=manifest.window_size,
        window_layers=None if len(layers) in (0, config.num_layers) else layers,
    )
