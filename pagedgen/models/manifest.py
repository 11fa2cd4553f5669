"""A checkpoint's decoder state manifest: derived from its config, or overridden by ``pagedgen.json``.

The derived manifest is the legacy one (one dense paged-KV group over every layer) plus the sliding window
the config declares (:func:`pagedgen.models.config.config_from_hf` reads ``sliding_window``,
``use_sliding_window``, ``layer_types`` and ``max_window_layers``). A ``pagedgen.json`` beside the checkpoint
(in an HF directory; ``<file>.pagedgen.json`` beside a GGUF file) can replace it::

    {"decoder": {"state_groups": [{"kind": "paged_kv", "layers": [0, 1, 2, 3]}],
                 "sliding_window": {"size": 4096, "layers": [0, 2]}}}

A key the override leaves out keeps the derived value. The manifest is the truth the model follows: its
windowed layers are the ones the runtime masks and the engine keeps in rings. Every layer of our runtimes
attends, so every layer must own paged K/V; the engine decides separately what it can serve
(:meth:`StateManifest.dynamic_engine_problems`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pagedgen.core.manifest import SlidingWindow, StateManifest
from pagedgen.errors import ModelLoadError, StateManifestError
from pagedgen.models.config import ModelConfig
from pagedgen.models.hf_loader import read_json

OVERRIDE_FILE = "pagedgen.json"


def derived_manifest(config: ModelConfig, source: str = "model config") -> StateManifest:
    """The manifest the config implies: the legacy paged group and the config's sliding window."""
    window = None
    if config.sliding_window is not None:
        window = SlidingWindow(config.sliding_window, config.windowed_layers)
    return StateManifest(config.num_layers, (), window, source)


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


def apply_manifest(config: ModelConfig, manifest: StateManifest) -> ModelConfig:
    """``config`` with the manifest's sliding window; refuses a manifest that leaves a layer without K/V."""
    missing = sorted(set(range(config.num_layers)) - set(manifest.paged_layers))
    if missing:
        raise StateManifestError(
            f"{manifest.source}: layers {missing} attend but belong to no paged_kv group "
            f"(this {config.architecture} runtime keeps paged K/V in every layer)"
        )
    layers = manifest.window_layers
    return dataclasses.replace(
        config,
        sliding_window=manifest.window_size,
        window_layers=None if len(layers) in (0, config.num_layers) else layers,
    )
