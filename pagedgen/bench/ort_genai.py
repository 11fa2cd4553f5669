"""ONNX Runtime GenAI baselines: ``og.Generator`` on an fp32 (``ort-genai``) and an int4 (``-int4``) export.

Why two exports made by og's own model builder: the fp32 one compares the engines on bit-identical weights,
the int4 one is og's own quantised path; each is built once, keyed by what it is made from.
docs/performance.md, "Module notes: ops and bench", has the rest.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from types import ModuleType

from pagedgen.bench.checkpoints import NO_CHECKPOINT, hf_dir_for_loaders
from pagedgen.bench.extras import INSTALL_HINT, importable
from pagedgen.bench.records import SystemRun, SystemSkipped
from pagedgen.bench.workloads import BenchRequest, batches
from pagedgen.core.paths import cache_root

EXPORT_FORMAT = 1  # bump when the staging of the builder's input or the builder arguments change
MAX_BATCH = 32
BUILDER = (sys.executable, "-m", "onnxruntime_genai.models.builder")


def og_version() -> str:
    try:
        return metadata.version("onnxruntime-genai")
    except metadata.PackageNotFoundError:
        return "not installed"


def export_key(checkpoint_dir: Path, precision: str, version: str) -> str:
    """16 hex digits over every source file's name and content, the og version and the precision."""
    from pagedgen.models.gguf_cache import file_sha256

    digest = hashlib.sha256(f"v{EXPORT_FORMAT}\0{precision}\0cpu\0{version}\0".encode())
    for path in sorted(p for p in checkpoint_dir.iterdir() if p.is_file()):
        digest.update(f"{path.name}\0{file_sha256(path)}\0".encode())
    return digest.hexdigest()[:16]


def export_dir(checkpoint_dir: Path, precision: str, root: Path | None = None) -> Path:
    key = export_key(checkpoint_dir, precision, og_version())
    return (root or cache_root()) / f"ort-genai-v{EXPORT_FORMAT}" / f"{precision}-cpu-{key}"


def ensure_export(
    checkpoint_dir: Path, precision: str, *, root: Path | None = None, builder: Sequence[str] = BUILDER
) -> Path:
    """The export's directory, built with the model builder unless it exists.

    Raises ``RuntimeError`` with the builder's output when it fails; nothing is left in the cache then.
    """
    final = export_dir(checkpoint_dir, precision, root)
    if (final / "genai_config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp"))
    try:
        source = hf_dir_for_loaders(checkpoint_dir, scratch / "input")
        out = scratch / "export"
        command = [*builder, "-i", str(source), "-o", str(out), "-p", precision, "-e", "cpu"]
        command += ["-c", str(scratch / "builder-cache")]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not (out / "genai_config.json").is_file():
            tail = (done.stderr or done.stdout)[-2000:]
            raise RuntimeError(f"the model builder failed ({' '.join(command)}): {tail}")
        try:
            os.replace(out, final)  # atomic; a concurrent builder that finished first keeps its copy
        except OSError:
            if not (final / "genai_config.json").is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return final


def right_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> list[list[int]]:
    """Prompts padded on the right to the longest; raises ValueError if a prompt holds ``pad_id`` itself."""
    for i, p in enumerate(prompts):
        if pad_id in p:
            raise ValueError(f"prompt {i} contains og's pad token {pad_id}, which og would mask out")
    width = max(len(p) for p in prompts)
    return [list(p) + [pad_id] * (width - len(p)) for p in prompts]


class OrtGenai:
    """One export (``precision``) of one checkpoint: built and loaded on the first run, reused after."""

    def __init__(self, checkpoint_dir: Path | None, precision: str):
        self.checkpoint_dir = checkpoint_dir
        self.precision = precision
        self._model: object | None = None  # og.Model: onnxruntime_genai ships no type information
        self._pad_id = 0
        self._export: Path | None = None

    def run(self, requests: Sequence[BenchRequest], max_batch_size: int) -> SystemRun:
        if not importable("onnxruntime_genai"):
            raise SystemSkipped(f"onnxruntime_genai is not importable in this environment ({INSTALL_HINT})")
        if self.checkpoint_dir is None:
            raise SystemSkipped(NO_CHECKPOINT)
        og = self._load()
        size = min(max_batch_size, MAX_BATCH)
        outputs: list[list[int]] = []
        start = time.perf_counter()
        for batch in batches(requests, size):
            outputs += self._generate(og, batch)
        wall = time.perf_counter() - start
        details = {"export": str(self._export), "batch_size": size, "og_version": og_version()}
        return SystemRun(outputs, wall, details=details)

    def _load(self) -> ModuleType:
        import onnxruntime_genai as og  # type: ignore[import-not-found]

        if self._model is None:
            assert self.checkpoint_dir is not None
            self._export = ensure_export(self.checkpoint_dir, self.precision)
            config = json.loads((self._export / "genai_config.json").read_text())
            self._pad_id = int(config["model"]["pad_token_id"])
            self._model = og.Model(str(self._export))
        return og

    def _generate(self, og: ModuleType, batch: Sequence[BenchRequest]) -> list[list[int]]:
        import numpy as np

        ids = right_pad([r.prompt_ids for r in batch], self._pad_id)
        width = len(ids[0])
        total = width + max(r.output_len for r in batch)
        params = og.GeneratorParams(self._model)
        params.set_search_options(do_sample=False, max_length=total, min_length=total, batch_size=len(batch))
        generator = og.Generator(self._model, params)
        generator.append_tokens(np.array(ids, dtype=np.int32))  # [batch, width]
        while not generator.is_done():
            generator.generate_next_token()
        rows = [generator.get_sequence(i)[width:] for i in range(len(batch))]  # the generated part
        return [[int(t) for t in row[: r.output_len]] for row, r in zip(rows, batch, strict=True)]
