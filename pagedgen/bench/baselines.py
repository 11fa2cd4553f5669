"""The systems pagedgen is measured against, on the same weights, dtype, threads and batch size.

Why these: each is how its project serves the same job (static and continuous batching in transformers, ONNX
Runtime GenAI, vLLM's CPU build, llama.cpp's server), all greedy with EOS ignored on the same weights, dtype,
threads and batch size, so a ratio compares the systems and nothing else. docs/performance.md, "Module notes:
ops and bench", has the rest.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pagedgen.bench.checkpoints import NO_CHECKPOINT
from pagedgen.bench.records import SystemRun, SystemSkipped
from pagedgen.bench.workloads import BenchRequest, batches

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel
    from transformers.generation.continuous_batching import ContinuousBatchingManager

CB_STOP_TIMEOUT_S = 600.0
BASELINE_NAMES = ("hf-static", "hf-cb", "ort-genai", "ort-genai-int4", "vllm", "vllm-eager", "llama.cpp")


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[list[list[int]], list[list[int]]]:
    """Left-padded ids and attention masks (1 = real token) to the longest prompt."""
    width = max(len(p) for p in prompts)
    ids = [[pad_id] * (width - len(p)) + list(p) for p in prompts]
    masks = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
    return ids, masks


class TransformersBaselines:
    """``hf-static`` and ``hf-cb`` over one lazily loaded transformers model of ``checkpoint_dir``.

    ``device`` / ``dtype`` (default: the CPU, float32) are pagedgen's, so a GPU run compares like with like.
    """

    def __init__(
        self,
        checkpoint_dir: Path | None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        self.checkpoint_dir = checkpoint_dir
        self.device = "cpu" if device is None else device
        self.dtype = dtype
        self._model: PreTrainedModel | None = None

    def model(self) -> PreTrainedModel:
        if self._model is None:
            import torch
            from transformers import AutoModelForCausalLM

            if self.checkpoint_dir is None:
                raise SystemSkipped(NO_CHECKPOINT)
            if not (self.checkpoint_dir / "config.json").is_file():
                raise SystemSkipped(f"{self.checkpoint_dir} has no config.json for transformers to load")
            model = AutoModelForCausalLM.from_pretrained(
                self.checkpoint_dir, dtype=self.dtype or torch.float32, attn_implementation="sdpa"
            )
            model.generation_config.eos_token_id = None  # ignore EOS, like every system here
            self._model = model.to(self.device).eval()
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
                    input_ids=torch.tensor(ids, device=self.device),
                    attention_mask=torch.tensor(masks, device=self.device),
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


def _collect_cb(manager: ContinuousBatchingManager, requests: Sequence[BenchRequest]) -> list[list[int]]:
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


def baseline_runners(
    names: Sequence[str],
    checkpoint_dir: Path | None,
    *,
    vllm_venv: Path | None = None,
    llama_cpp_dir: Path | None = None,
    threads: int = 1,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> dict[str, Callable[[Sequence[BenchRequest], int], SystemRun]]:
    """Runners for ``names`` (in order); raises ValueError naming an unknown baseline.

    ``vllm_venv`` is the root of the venv holding vLLM (default: this interpreter's), ``threads`` the number
    of cores the vLLM baselines are bound to (and llama.cpp's ``-t``), ``llama_cpp_dir`` the folder of
    llama.cpp's binaries; ``device`` / ``dtype`` those of the transformers baselines.
    """
    from pagedgen.bench.llama_cpp import LlamaCpp
    from pagedgen.bench.ort_genai import OrtGenai
    from pagedgen.bench.vllm_runner import Vllm

    unknown = [n for n in names if n not in BASELINE_NAMES]
    if unknown:
        raise ValueError(f"unknown baseline(s) {unknown}; known: {', '.join(BASELINE_NAMES)}")
    hf = TransformersBaselines(checkpoint_dir, device=device, dtype=dtype)
    table: dict[str, Callable[[Sequence[BenchRequest], int], SystemRun]] = {  # nothing loads before a run
        "hf-static": hf.run_static,
        "hf-cb": hf.run_continuous,
        "ort-genai": OrtGenai(checkpoint_dir, "fp32").run,
        "ort-genai-int4": OrtGenai(checkpoint_dir, "int4").run,
        "vllm": Vllm(checkpoint_dir, vllm_venv, enforce_eager=False, threads=threads).run,
        "vllm-eager": Vllm(checkpoint_dir, vllm_venv, enforce_eager=True, threads=threads).run,
        "llama.cpp": LlamaCpp(llama_cpp_dir, checkpoint_dir, threads=threads).run,
    }
    return {name: table[name] for name in names}
