"""Cache a GGUF file as an HF-style checkpoint directory of dequantised safetensors, keyed by its sha256.

Parsing and dequantising a GGUF file takes seconds and reading back safetensors a fraction of one, so the
first load writes an entry that every later load reads like any HF checkpoint; entries are built atomically
and keyed by content. What an entry holds and how it is built: docs/models.md, "GGUF files: the cache
entry".
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from pagedgen import errors
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
from pagedgen.models.native_weights import native_blocks, write_native_file
from pagedgen.models.safetensors_stream import TensorSpec, write_safetensors
from pagedgen.ops.matmul.quant_gemm import dequantize
from pagedgen.ops.matmul.qweight import NATIVE_GGUF_TYPES, QuantizedWeight

log = logging.getLogger(__name__)

CACHE_FORMAT = 4  # bump when the entry layout or the dequantisation changes (2: native.safetensors; 3: its
# fused projections back to back, Q2_K/Q3_K/Q5_x kept as blocks; 4: config.json's query_pre_attn_scalar an
# int, as transformers' config classes require)
_HASH_CHUNK = 1 << 22
CHUNK_BYTES = 8 << 20  # float32 bytes of one chunk of rows written to model.safetensors
# Files this large are built in a child process (:func:`build_entry_in_child`); smaller ones (test files,
# which have tiny vocabularies) are built in this process, where starting an interpreter would cost more
# than the memory it saves.
CHILD_BUILD_MIN_BYTES = 16 << 20
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
    """Build ``entry`` from ``path``: in a child process for a file of :data:`CHILD_BUILD_MIN_BYTES` or
    more, else here (:func:`build_entry_here`)."""
    if path.stat().st_size >= CHILD_BUILD_MIN_BYTES:
        build_entry_in_child(path, entry)
    else:
        build_entry_here(path, entry)


def build_entry_in_child(path: Path, entry: Path) -> None:
    """Run :func:`build_entry_here` in a fresh interpreter and wait for it; its error is raised here.

    Why: parsing a GGUF file's vocabulary (the ``gguf`` reader's per-token fields, transformers' tokenizer
    converter and its imports) leaves hundreds of MB of Python objects in fragmented arenas that no
    ``malloc_trim`` returns (about 215 MB for a 262k-token vocabulary), so a process that built an entry
    stayed about 1.9x the file larger than one that read it. The child ends, and with it all of that; this
    process then loads the entry as any later load would. The child imports from this process's
    ``sys.path`` and uses its torch thread count. Its error (a :class:`pagedgen.errors.PagedGenError`) comes
    back as the same class and message; a child that dies otherwise is a :class:`ModelLoadError` with the
    end of its output.
    """
    request = json.dumps(
        {"path": str(path), "entry": str(entry), "sys_path": sys.path, "threads": torch.get_num_threads()}
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD_CODE, request], capture_output=True, text=True, check=False
        )
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot start a process to build the weight cache ({exc})") from exc
    if done.returncode == 0:
        if done.stderr.strip():
            log.debug("the weight cache build for %s said: %s", path, done.stderr.strip())
        return
    lines = done.stdout.strip().splitlines()
    reply = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None
    error = getattr(errors, reply["error"], None) if reply else None
    if isinstance(error, type) and issubclass(error, errors.PagedGenError):
        raise error(reply["message"])
    tail = (done.stderr or done.stdout).strip()[-2000:]
    raise ModelLoadError(f"{path}: building the weight cache failed (exit {done.returncode}): {tail}")


# The child's whole program: the parent's import path, then build_entry_here; a PagedGenError is printed as
# one JSON line on stdout (the parent raises it again), anything else is a traceback and a non-zero exit.
_CHILD_CODE = """
import json, sys
request = json.loads(sys.argv[1])
sys.path[:] = request["sys_path"]
import torch
torch.set_num_threads(request["threads"])
from pathlib import Path
from pagedgen.errors import PagedGenError
from pagedgen.models.gguf_cache import build_entry_here
try:
    build_entry_here(Path(request["path"]), Path(request["entry"]))
except PagedGenError as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
    sys.exit(3)
"""


def build_entry_here(path: Path, entry: Path) -> None:
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
        tensors = ((p.name, _float32_rows(file, p, config)) for p in plans)
        write_safetensors(tmp / "model.safetensors", specs, tensors, {"format": "pt", "sha256": entry.name})
        write_native_file(tmp, file, plans, config)
        _publish(tmp, entry)
    except OSError as exc:
        raise ModelLoadError(f"{entry}: cannot write the weight cache (set ${CACHE_DIR_ENV}): {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        release_freed_memory()


def _float32_rows(file: GGUFFile, plan: WeightPlan, config: ModelConfig) -> Iterator[torch.Tensor]:
    """One tensor's float32 values in HF layout, in chunks of rows of at most :data:`CHUNK_BYTES`.

    Why chunks: the 262k-row embedding of a Gemma 3 file is 671 MB as float32, and gguf-py's dequantiser
    holds several arrays of that size at once. A native-type 2-D tensor is expanded from its (already
    unpermuted) blocks by :func:`pagedgen.ops.matmul.quant_gemm.dequantize`, bit-identical to gguf-py; any
    other tensor (norms, biases) is small and goes whole through :func:`dequantize_weight`.
    """
    blocks = native_blocks(file, plan, config)
    if blocks is None:
        yield torch.from_numpy(dequantize_weight(file, plan, config))
        return
    qtype = NATIVE_GGUF_TYPES[plan.ggml_type]
    rows, k = plan.shape
    step = max(1, CHUNK_BYTES // (4 * k))
    for start in range(0, rows, step):
        part = torch.from_numpy(np.array(blocks[start : start + step]))  # a copy: the map is read-only
        yield dequantize(QuantizedWeight(qtype, (part.shape[0], k), part))


def release_freed_memory() -> None:
    """Hand the allocator's free pages back to the system (glibc's ``malloc_trim``; elsewhere nothing).

    Why: building an entry frees hundreds of MB in pieces below glibc's mmap threshold, which it keeps in
    its heaps; without this a first load's process stays 3x the file larger than a later load's.
    """
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


def _publish(tmp: Path, entry: Path) -> None:
    """Rename ``tmp`` to ``entry``; if another process published first, keep theirs."""
    try:
        os.rename(tmp, entry)
    except OSError:
        if not entry.is_dir():
            raise
