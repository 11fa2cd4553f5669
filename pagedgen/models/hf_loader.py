"""Read an HF checkpoint directory: ``config.json`` and safetensors weights (one file or index-sharded).

Only safetensors are read (pickle-based ``.bin`` checkpoints are refused, never unpickled) and no code from
the directory is imported or run. Every failure raises :class:`ModelLoadError` naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pagedgen.core.json_value import JsonValue
from pagedgen.errors import ModelLoadError
from pagedgen.models.config import ModelConfig, config_from_hf

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def read_json(path: Path) -> dict[str, JsonValue]:
    """A JSON object from ``path``; raises :class:`ModelLoadError` naming the file if missing or invalid."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ModelLoadError(f"{path}: file not found") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: not a valid JSON file ({exc})") from exc
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def read_hf_config(directory: Path) -> ModelConfig:
    """The model config of a checkpoint dir, with ``generation_config.json``'s EOS ids merged in."""
    if not directory.is_dir():
        raise ModelLoadError(f"{directory}: checkpoint directory not found")
    raw = read_json(directory / CONFIG_FILE)
    generation = directory / GENERATION_CONFIG_FILE
    if generation.is_file():
        extra = read_json(generation).get("eos_token_id")
        if extra is not None:
            own = raw.get("eos_token_id")
            own_list = [] if own is None else [own] if isinstance(own, int) else list(own)
            extra_list = [extra] if isinstance(extra, int) else list(extra)
            raw = {**raw, "eos_token_id": list(dict.fromkeys(own_list + extra_list))}
    return config_from_hf(raw, str(directory / CONFIG_FILE))


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint, single or sharded; refuses pickle-only checkpoints."""
    single = directory / WEIGHTS_FILE
    if single.is_file():
        return [single]
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: has no 'weight_map' object")
        shards = [directory / name for name in dict.fromkeys(weight_map.values())]
        for shard in shards:
            if not shard.is_file():
                raise ModelLoadError(f"{shard}: shard listed in {index.name} not found")
        return shards
    if any(directory.glob("*.bin")) or any(directory.glob("*.pt")):
        raise ModelLoadError(
            f"{directory}: only pickle weights (*.bin/*.pt) found; pagedgen never unpickles, "
            "convert them to safetensors"
        )
    raise ModelLoadError(f"{directory}: no {WEIGHTS_FILE} or {INDEX_FILE} found")


def read_safetensors(path: Path, device: torch.device) -> dict[str, torch.Tensor]:
    """All tensors of one safetensors file; raises :class:`ModelLoadError` if it is truncated or corrupt."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path, device=str(device))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"{path}: truncated or corrupt safetensors file ({exc})") from exc


def read_hf_weights(directory: Path, device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint by name; a tensor present in two shards is an error."""
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        shard = read_safetensors(path, device)
        duplicated = set(shard) & set(tensors)
        if duplicated:
            raise ModelLoadError(f"{path}: tensor(s) {sorted(duplicated)[:5]} also appear in another shard")
        tensors.update(shard)
    return tensors
