"""The systems pagedgen is measured against, each run in this process on the same weights, dtype and threads.

* ``hf-static``: transformers ``generate`` over left-padded static batches of ``max_batch_size``; a batch
  runs to its longest request and each request keeps its own length (the rest is static batching's waste).
* ``hf-cb``: transformers' own continuous batching (``ContinuousBatchingManager``, the engine behind
  ``generate_batch``) with each request's own ``max_new_tokens``.
* ``vllm``: vLLM's CPU build (fp32, eager), only if ``vllm`` is importable; never a pagedgen dependency.
* ``ort-genai``: ONNX Runtime GenAI ``og.Generator`` in batches of up to 32 over an fp32 CPU export of the
  same weights (made once with its model builder), only if ``onnxruntime_genai`` is importable.

Every runner takes ``(requests, max_batch_size)`` and returns a :class:`SystemRun`, or raises
:class:`SystemSkipped` naming why it cannot run here. All are greedy with EOS ignored. The transformers model
is loaded once from pagedgen's checkpoint directory (for a GGUF file: its dequantised fp32 cache entry, i.e.
bit-identical weights) and shared by both transformers systems.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pagedgen.bench.records import SystemRun, SystemSkipped
from pagedgen.bench.workloads import BenchRequest

ORT_GENAI_MAX_BATCH = 32
CB_STOP_TIMEOUT_S = 600.0
NO_CHECKPOINT = "the model has no checkpoint directory (e.g. the synthetic model): nothing for it to load"
BASELINE_NAMES = ("hf-static", "hf-cb", "vllm", "ort-genai")


def importable(module: str) -> bool:
    """True when ``module`` can be imported here (checked without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def batches(requests: Sequence[BenchRequest], size: int) -> list[Sequence[BenchRequest]]:
    """Consecutive batches of at most ``size`` requests, in workload order."""
    if size <= 0:
        raise ValueError(f"batch size must be positive, got {size}")
    return [requests[i : i + size] for i in range(0, len(requests), size)]


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[list[list[int]], list[list[int]]]:
    """Left-padded ids and attention masks (1 = real token) to the longest prompt."""
    width = max(len(p) for p in prompts)
    ids = [[pad_id] * (width - len(p)) + list(p) for p in prompts]
    masks = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
    return ids, masks


class TransformersBaselines:
    """``hf-static`` and ``hf-cb`` over one lazily loaded transformers model of ``checkpoint_dir``."""

    def __init__(self, checkpoint_dir: Path | None):
        self.checkpoint_dir = checkpoint_dir
        self._model: Any = None

    def model(self) -> Any:
        if self._model is None:
            import torch
            from transformers import AutoModelForCausalLM

            if self.checkpoint_dir is None:
                raise SystemSkipped(NO_CHECKPOINT)
            if not (self.checkpoint_dir / "config.json").is_file():
                raise SystemSkipped(f"{self.checkpoint_dir} has no config.json for transformers to load")
            model = AutoModelForCausalLM.from_pretrained(
                self.checkpoint_dir, dtype=torch.float32, attn_implementation="sdpa"
            )
            model.generation_config.eos_token_id = None  # ignore EOS, like every system here
            self._model = model.eval()
        return self._model

    def run_static(self, requests: Sequence[BenchRequest], max_batch_size: int) -> SystemRun:
        import torch
        from transformers import GenerationConfig

        model = self.model()
        pad_id = 0
        outputs: list[list[int]] = []
        start = time.perf_counter()
        with torch.inference_mode():
            for batch in batches(requests, max_batch_size):
                ids, masks = left_pad([r.prompt_ids for r in batch], pad_id)
                longest = max(r.output_len for r in batch)
                config = GenerationConfig(
                    max_new_tokens=longest,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=pad_id,
                )
                out = model.generate(
                    input_ids=torch.tensor(ids),
                    attention_mask=torch.tensor(masks),
                    generation_config=config,
                )  # [batch, width + longest]
                new = out[:, len(ids[0]) :].tolist()
                outputs += [row[: r.output_len] for row, r in zip(new, batch, strict=True)]
        wall = time.perf_counter() - start
        return SystemRun(outputs, wall, details={"batches": -(-len(requests) // max_batch_size)})

    def run_continuous(self, requests: Sequence[BenchRequest], max_batch_size: int) -> SystemRun:
        import transformers
        from transformers import GenerationConfig

        config_class = getattr(transformers, "ContinuousBatchingConfig", None)
        if config_class is None:
            raise SystemSkipped(f"transformers {transformers.__version__} has no continuous batching API")
        model = self.model()
        longest = max(len(r.prompt_ids) + r.output_len for r in requests)
        page = 256
        num_blocks = max_batch_size * -(-longest // page) + 2
        manager = model.init_continuous_batching(
            generation_config=GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=longest),
            continuous_batching_config=config_class(
                page_size=page,
                num_blocks=num_blocks,
                max_batch_tokens=2048,
                max_requests_per_batch=max_batch_size,
                allow_block_sharing=False,
            ),
        )
        start = time.perf_counter()
        manager.start()
        try:
            outputs = _collect_cb(manager, requests)
            wall = time.perf_counter() - start
        finally:
            # Wait for the generation thread to exit: on a join timeout transformers drops the batch
            # processor while the thread still runs, which breaks the next manager of this model.
            manager.stop(block=True, timeout=CB_STOP_TIMEOUT_S)
            manager.destroy()
        return SystemRun(outputs, wall, kv_blocks_total=num_blocks)


def _collect_cb(manager: Any, requests: Sequence[BenchRequest]) -> list[list[int]]:
    ids = [
        manager.add_request(
            list(r.prompt_ids), request_id=f"r{i}", max_new_tokens=r.output_len, eos_token_id=-1
        )
        for i, r in enumerate(requests)
    ]
    index = {rid: i for i, rid in enumerate(ids)}
    outputs: list[list[int] | None] = [None] * len(requests)
    remaining = len(requests)
    while remaining:
        result = manager.get_result(timeout=1.0)
        if result is None:
            if manager.is_running():
                continue  # a long step (a big prefill on a busy machine) is still running
            raise RuntimeError(
                f"transformers continuous batching stopped with {remaining} requests unfinished"
            )
        if result.is_finished() and outputs[index[result.request_id]] is None:
            outputs[index[result.request_id]] = list(result.generated_tokens)
            remaining -= 1
    return [o or [] for o in outputs]


def run_vllm(checkpoint_dir: Path | None, requests: Sequence[BenchRequest], max_batch_size: int) -> SystemRun:
    """vLLM's offline ``LLM.generate`` (fp32, eager) on token-id prompts. Skipped when not importable."""
    if not importable("vllm"):
        raise SystemSkipped("vllm is not importable in this environment (pagedgen never depends on it)")
    if checkpoint_dir is None:
        raise SystemSkipped(NO_CHECKPOINT)
    from vllm import SamplingParams  # type: ignore[import-not-found]

    llm = _vllm_engine(checkpoint_dir, max_batch_size)
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    prompts = [{"prompt_token_ids": list(r.prompt_ids)} for r in requests]
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    return SystemRun([list(r.outputs[0].token_ids) for r in results], wall)


_VLLM_ENGINES: dict[tuple[str, int], Any] = {}


def _vllm_engine(checkpoint_dir: Path, max_batch_size: int) -> Any:
    from vllm import LLM  # type: ignore[import-not-found]

    key = (str(checkpoint_dir), max_batch_size)
    if key not in _VLLM_ENGINES:
        _VLLM_ENGINES[key] = LLM(
            model=str(checkpoint_dir), dtype="float32", enforce_eager=True, max_num_seqs=max_batch_size
        )
    return _VLLM_ENGINES[key]


def ort_export_dir(checkpoint_dir: Path) -> Path:
    """Where the fp32 CPU export of ``checkpoint_dir`` lives (built once next to the checkpoint)."""
    return Path(checkpoint_dir) / "ort-genai-fp32-cpu"


def ensure_ort_export(checkpoint_dir: Path) -> Path:
    """Build the fp32 CPU export with ONNX Runtime GenAI's model builder unless it exists."""
    out = ort_export_dir(checkpoint_dir)
    if (out / "genai_config.json").is_file():
        return out
    command = [
        sys.executable, "-m", "onnxruntime_genai.models.builder",
        "-i", str(checkpoint_dir), "-o", str(out), "-p", "fp32", "-e", "cpu",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"model builder failed ({' '.join(command)}): {done.stderr[-2000:]}")
    return out


def run_ort_genai(
    checkpoint_dir: Path | None, requests: Sequence[BenchRequest], max_batch_size: int
) -> SystemRun:
    """``og.Generator`` over batches of up to 32 requests of equal prompt length (no padding semantics).

    Requests are grouped by prompt length (stable order) because how og pads batched prompts of different
    lengths is not something this bench can verify; W1 and B1 batch normally, W2's batches are smaller.
    """
    if not importable("onnxruntime_genai"):
        raise SystemSkipped("onnxruntime_genai is not importable in this environment")
    if checkpoint_dir is None:
        raise SystemSkipped(NO_CHECKPOINT)
    import numpy as np
    import onnxruntime_genai as og  # type: ignore[import-not-found]

    model = og.Model(str(ensure_ort_export(checkpoint_dir)))
    size = min(max_batch_size, ORT_GENAI_MAX_BATCH)
    by_len: dict[int, list[int]] = {}
    for i, r in enumerate(requests):
        by_len.setdefault(len(r.prompt_ids), []).append(i)
    outputs: list[list[int]] = [[] for _ in requests]
    start = time.perf_counter()
    for length, members in by_len.items():
        for group in batches(members, size):
            longest = max(requests[i].output_len for i in group)
            params = og.GeneratorParams(model)
            params.set_search_options(do_sample=False, max_length=length + longest, batch_size=len(group))
            generator = og.Generator(model, params)
            generator.append_tokens(np.array([requests[i].prompt_ids for i in group], dtype=np.int32))
            while not generator.is_done():
                generator.generate_next_token()
            for row, i in enumerate(group):
                outputs[i] = list(generator.get_sequence(row))[length : length + requests[i].output_len]
    return SystemRun(outputs, time.perf_counter() - start)


def baseline_runners(
    names: Sequence[str], checkpoint_dir: Path | None
) -> dict[str, Callable[[Sequence[BenchRequest], int], SystemRun]]:
    """Runners for ``names`` (in order); raises ValueError naming an unknown baseline."""
    unknown = [n for n in names if n not in BASELINE_NAMES]
    if unknown:
        raise ValueError(f"unknown baseline(s) {unknown}; known: {', '.join(BASELINE_NAMES)}")
    hf = TransformersBaselines(checkpoint_dir)
    table: dict[str, Callable[[Sequence[BenchRequest], int], SystemRun]] = {
        "hf-static": hf.run_static,
        "hf-cb": hf.run_continuous,
        "vllm": lambda reqs, batch: run_vllm(checkpoint_dir, reqs, batch),
        "ort-genai": lambda reqs, batch: run_ort_genai(checkpoint_dir, reqs, batch),
    }
    return {name: table[name] for name in names}
