"""Cache a GGUF file as an HF-style checkpoint directory of dequantised safetensors, keyed by its sha256.

Opening a GGUF file and dequantising it takes seconds (the ``gguf`` reader parses the whole vocabulary in
Python, the quant blocks are expanded in numpy, the tokenizer is rebuilt); reading back float32 safetensors
takes a fraction of a second. So the first load writes ``config.json``, ``model.safetensors``,
``tokenizer.json`` and ``tokenizer_config.json`` into ``<cache root>/gguf-v<N>/<sha256 of the file>/`` and
every later load reads that directory like any HF checkpoint.

The key is the sha256 of the whole file, streamed (about 0.2 s for the 98 MB default model): a file edited in
place gets a new entry, and a renamed or copied file reuses the old one. An entry is built in a temporary
sibling directory and renamed into place, so a reader never sees a half-written entry and two processes
racing to build the same entry both end with one complete copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from pagedgen.core.paths import CACHE_DIR_ENV, cache_root
from pagedgen.errors import ModelLoadError
from pagedgen.models.config import ModelConfig
from pagedgen.models.gguf_reader import (
    GGUFFile,
    WeightPlan,
    dequantize_weight,
    gguf_config,
    open_gguf,
    plan_weights,
)
from pagedgen.models.gguf_tokenizer import gguf_tokenizer_files
from pagedgen.models.safetensors_stream import TensorSpec, write_safetensors

CACHE_FORMAT = 1  # bump when the entry layout or the dequantisation changes
_HASH_CHUNK = 1 << 22
_KEPT_TYPES = {"F16": "F16", "BF16": "BF16"}  # stored as-is (lossless); every quantised type becomes F32


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks (constant memory)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def gguf_cache_dir(path: Path, root: Path | None = None) -> Path:
    """Where the entry for ``path`` lives (it may not exist yet); hashes the file."""
    if not path.is_file():
        raise ModelLoadError(f"{path}: GGUF file not found")
    return (root or cache_root()) / f"gguf-v{CACHE_FORMAT}" / file_sha256(path)


def ensure_gguf_entry(path: Path, entry: Path, rebuild: bool = False) -> bool:
    """Build ``entry`` from ``path`` unless it exists (or ``rebuild``); returns whether it was built.

    Raises :class:`ModelLoadError` if the file is unreadable or unsupported (nothing is written then), or
    if the cache directory cannot be written.
    """
    if entry.is_dir() and not rebuild:
        return False
    if entry.is_dir():
        shutil.rmtree(entry, ignore_errors=True)
    _build_entry(path, entry)
    return True


def gguf_cache_entry(path: Path, root: Path | None = None, rebuild: bool = False) -> Path:
    """The cache directory holding ``path`` as an HF checkpoint, built on first use (or when ``rebuild``)."""
    entry = gguf_cache_dir(path, root)
    ensure_gguf_entry(path, entry, rebuild)
    return entry


def _build_entry(path: Path, entry: Path) -> None:
    """Dequantise ``path`` into a temporary directory, then rename it to ``entry`` (atomic publish)."""
    file = open_gguf(path)
    config = gguf_config(file)
    plans = plan_weights(file)  # refuses unknown tensors and unsupported quant types before any work
    tokenizer_files = gguf_tokenizer_files(file)  # None: weights only, Tokenizer(model) will refuse
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name[:12]}-", dir=entry.parent))
    except OSError as exc:
        raise ModelLoadError(
            f"{entry.parent}: cannot create the weight cache (set ${CACHE_DIR_ENV}): {exc}"
        ) from exc
    try:
        hf_config = {**config.to_hf_dict(), "pagedgen_source": {"gguf": str(path), "sha256": entry.name}}
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2), encoding="utf-8")
        if tokenizer_files is not None:
            tokenizer_json, tokenizer_config = tokenizer_files
            (tmp / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
            (tmp / "tokenizer_config.json").write_text(
                json.dumps(tokenizer_config, indent=2), encoding="utf-8"
            )
        specs = [TensorSpec(p.name, _KEPT_TYPES.get(p.ggml_type, "F32"), p.shape) for p in plans]
        tensors = ((p.name, _as_tensor(file, p, config)) for p in plans)
        write_safetensors(tmp / "model.safetensors", specs, tensors, {"format": "pt", "sha256": entry.name})
        _publish(tmp, entry)
    except OSError as exc:
        raise ModelLoadError(f"{entry}: cannot write the weight cache (set ${CACHE_DIR_ENV}): {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _as_tensor(file: GGUFFile, plan: WeightPlan, config: ModelConfig) -> torch.Tensor:
    return torch.from_numpy(dequantize_weight(file, plan, config))


def _publish(tmp: Path, entry: Path) -> None:
    """Rename ``tmp`` to ``entry``; if another process published first, keep theirs."""
    try:
        os.rename(tmp, entry)
    except OSError:
        if not entry.is_dir():
            raise
