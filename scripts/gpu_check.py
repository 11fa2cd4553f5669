"""Issue 17's device check: pagedgen against transformers on one GPU, in one process, into one JSON file.

What it measures (random weights from ``scripts/configs/smollm2-135m/config.json``, seeded, the same weights
for both systems):

1. bf16 throughput, pagedgen (continuous batching) and transformers ``generate`` (static batches):
   W1 = 64 x (100 -> 128) at max batch 64; batch 1 = 1 x (100 -> 128); wide = 256 x (100 -> 128) at max
   batch 256. Greedy, EOS ignored; each system gets an untimed warm-up first.
2. One decode step at 64 rows: median wall time (device synchronised around each step) and, from
   ``torch.profiler`` over a few steps, kernel launches, host synchronisations and ``.item()`` calls per
   step, and the GPU-busy fraction; plus the CUDA-graph registry's stats (``EngineConfig(cuda_graphs=True)``).
3. fp32 greedy match: 8 requests x 32 tokens, ragged prompt lengths, pagedgen vs transformers ``generate``
   one request at a time (no padding in the oracle); every token compared.

The JSON is rewritten after every section, so a run cut short still leaves what it measured.

Device facts for the GPU session (issue 17's lent machine):
  * one NVIDIA H200 (~139 GiB), torch 2.11+cu130, Triton, transformers and pytest installed;
  * NO fastapi and NO gguf there (carry small wheels if a test needs them), nothing can be downloaded;
  * the tree that travels is at most 64 MiB: no model files, hence random weights built here from a config;
  * 15 minutes of device time in all, at most 10 minutes per command; this script aims at under 5 minutes.

How to run it (docs/performance.md, "GPU check"), from the repository root on the device machine:

    python scripts/gpu_check.py --device cuda --out $OUT/gpu_check.json

and here on the CPU with tiny sizes (what ``tests/unit/test_gpu_check.py`` runs):

    python scripts/gpu_check.py --smoke --device cpu --config DIR --out /tmp/gpu_check.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python scripts/gpu_check.py` from a plain checkout
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

DEFAULT_CONFIG = ROOT / "scripts" / "configs" / "smollm2-135m"
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    requests: int
    prompt_len: int
    output_len: int
    max_batch: int


@dataclass(frozen=True, slots=True)
class Sizes:
    workloads: tuple[Workload, ...]
    decode_rows: int  # rows of the profiled decode step
    decode_steps: int  # steps timed (and a few of them profiled)
    fp32_requests: int
    fp32_tokens: int


FULL = Sizes(
    workloads=(
        Workload("W1", 64, 100, 128, 64),
        Workload("batch1", 1, 100, 128, 1),
        Workload("wide256", 256, 100, 128, 256),
    ),
    decode_rows=64,
    decode_steps=20,
    fp32_requests=8,
    fp32_tokens=32,
)
SMOKE = Sizes(
    workloads=(
        Workload("W1", 4, 8, 6, 4),
        Workload("batch1", 1, 8, 6, 1),
        Workload("wide256", 6, 8, 6, 6),
    ),
    decode_rows=3,
    decode_steps=4,
    fp32_requests=2,
    fp32_tokens=6,
)


def prompts(count: int, length: int, vocab: int, seed: int) -> list[tuple[int, ...]]:
    """Seeded random prompt ids clear of the special ids 0..2 (random weights: any ids will do)."""
    rng = np.random.default_rng(seed)
    return [tuple(int(t) for t in rng.integers(3, vocab, size=length)) for _ in range(count)]


def bench_requests(workload: Workload, vocab: int, seed: int) -> list[Any]:
    from pagedgen.bench.workloads import BenchRequest

    ids = prompts(workload.requests, workload.prompt_len, vocab, seed)
    return [BenchRequest(i, p, workload.output_len) for i, p in enumerate(ids)]


def engine_config(max_batch: int, longest: int, graphs: bool = True, block_size: int = 16) -> Any:
    """A pool sized for the workload (not a quarter of the GPU), so start-up cost stays small."""
    from pagedgen.engine.config import EngineConfig

    blocks = max_batch * -(-longest // block_size) + 16
    return EngineConfig(
        max_batch_size=max_batch, block_size=block_size, num_blocks=blocks, cuda_graphs=graphs
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def graph_stats(engine: Any) -> dict[str, Any] | None:
    """The runner's CUDA-graph stats (None where graphs are off: the CPU, or models they do not fit)."""
    graphs = getattr(getattr(engine, "_runner", None), "graphs", None)  # the runner is internal to the engine
    return None if graphs is None else graphs.stats.to_dict()


def match(outputs: list[list[int]], reference: list[list[int]]) -> dict[str, Any]:
    """Token-by-token agreement, and where each request first diverges (None: identical)."""
    same = sum(
        a == b for out, ref in zip(outputs, reference, strict=True) for a, b in zip(out, ref, strict=False)
    )
    total = sum(len(ref) for ref in reference)
    first = [
        next((i for i, (a, b) in enumerate(zip(out, ref, strict=False)) if a != b), None)
        for out, ref in zip(outputs, reference, strict=True)
    ]
    return {
        "matched_tokens": same,
        "compared_tokens": total,
        "rate": same / total if total else 1.0,
        "first_divergence": first,
    }


# -- sections ------------------------------------------------------------------------------------------


def throughput(model: Any, hf: Any, workload: Workload, seed: int, graphs: bool) -> dict[str, Any]:
    """pagedgen then transformers on one workload (each warmed up first)."""
    from pagedgen.bench.throughput import run_pagedgen, warmup_requests

    requests = bench_requests(workload, int(model.vocab_size), seed)
    config = engine_config(workload.max_batch, workload.prompt_len + workload.output_len, graphs)
    run_pagedgen(model, warmup_requests(requests), config)
    paged = run_pagedgen(model, requests, config).run
    hf.run_static(warmup_requests(requests), workload.max_batch)
    static = hf.run_static(requests, workload.max_batch)
    tokens = sum(r.output_len for r in requests)
    return {
        "workload": f"{workload.requests} x ({workload.prompt_len} -> {workload.output_len})",
        "max_batch": workload.max_batch,
        "output_tokens": tokens,
        "pagedgen": {"wall_s": paged.wall_s, "tok_s": tokens / paged.wall_s, **paged.details},
        "transformers_static": {"wall_s": static.wall_s, "tok_s": tokens / static.wall_s},
        "speedup": static.wall_s / paged.wall_s,
        "greedy_match_vs_transformers": match(paged.outputs, static.outputs),
    }


def decode_step(model: Any, rows: int, steps: int, seed: int, graphs: bool) -> dict[str, Any]:
    """Time ``steps`` decode steps at ``rows`` rows, then profile a few of them."""
    from pagedgen.engine.engine import Engine
    from pagedgen.engine.request import GeneratorParams, RequestOptions, TurnOptions

    device = torch.device(model.device)
    output_len = 4 * steps + 16
    engine = Engine(model, engine_config(rows, 100 + output_len, graphs))
    try:
        params = GeneratorParams(model)
        params.set_search_options(do_sample=False, ignore_eos=True)
        for ids in prompts(rows, 100, int(model.vocab_size), seed):
            request = engine.create_request(params, RequestOptions())
            options = TurnOptions(request)
            options.set_max_generated_tokens(output_len)
            request.begin_turn(list(ids), options)
        buffer = engine.create_event_buffer(4 * rows + 16)
        tokens = 0
        while tokens < 3 * rows:  # prefill done, each row decoded twice (a graph is captured on the 2nd use)
            tokens += sum(1 for e in engine.run(buffer) if e.token is not None)
        times = []
        for _ in range(steps):
            sync(device)
            start = time.perf_counter()
            engine.run(buffer)
            sync(device)
            times.append(time.perf_counter() - start)
        result: dict[str, Any] = {
            "rows": rows,
            "median_step_ms": 1e3 * float(np.median(times)),
            "min_step_ms": 1e3 * min(times),
            "graphs": graph_stats(engine),
        }
        try:
            result["profile"] = profile_steps(engine, buffer, device, steps=min(5, steps))
        except Exception as exc:  # the profiler is a bonus: its failure must not cost the figures above
            result["profile"] = {"error": f"{type(exc).__name__}: {exc}"}
        return result
    finally:
        engine.close()


def profile_steps(engine: Any, buffer: Any, device: torch.device, steps: int) -> dict[str, Any]:
    """Per step: kernel launches, host synchronisations, ``.item()``-like reads, GPU-busy fraction."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.run(buffer)
        sync(device)
    wall = time.perf_counter() - start
    kernels, kernel_us, syncs, items = 0, 0.0, 0, 0
    for event in prof.events():
        name = event.name
        if str(getattr(event, "device_type", "")).endswith("CUDA"):
            kernels += 1
            kernel_us += float(event.time_range.elapsed_us())
        elif any(name.startswith(call) and "Async" not in name for call in SYNC_CALLS):
            syncs += 1
        elif name == "aten::item":
            items += 1
    return {
        "steps": steps,
        "wall_ms_per_step": 1e3 * wall / steps,
        "kernels_per_step": kernels / steps,
        "host_syncs_per_step": syncs / steps,
        "item_calls_per_step": items / steps,  # .item() (and int(t) / float(t)) on any tensor
        "gpu_busy_fraction": (kernel_us / 1e6) / wall if device.type == "cuda" else None,
    }


def fp32_match(checkpoint: Path, device: torch.device, sizes: Sizes, seed: int) -> dict[str, Any]:
    """pagedgen fp32 vs transformers fp32, one request at a time in transformers (no padding)."""
    from transformers import AutoModelForCausalLM

    import pagedgen as pg
    from pagedgen.bench.throughput import run_pagedgen
    from pagedgen.bench.workloads import BenchRequest

    model = pg.Model(str(checkpoint), dtype="float32", device=str(device))
    vocab = int(model.vocab_size)
    lengths = [20 + 11 * i for i in range(sizes.fp32_requests)]  # ragged: different block-table widths
    requests = [
        BenchRequest(i, prompts(1, n, vocab, seed + i)[0], sizes.fp32_tokens) for i, n in enumerate(lengths)
    ]
    longest = max(lengths) + sizes.fp32_tokens
    paged = run_pagedgen(model, requests, engine_config(sizes.fp32_requests, longest)).run
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="sdpa")
    hf = hf.to(device).eval()
    reference = []
    with torch.inference_mode():
        for r in requests:
            ids = torch.tensor([r.prompt_ids], device=device)
            out = hf.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=r.output_len,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            reference.append(out[0, ids.shape[1] :].tolist())
    return {
        "requests": len(requests),
        "tokens_each": sizes.fp32_tokens,
        "prompt_lens": lengths,
        **match(paged.outputs, reference),
    }


# -- driver --------------------------------------------------------------------------------------------


def environment(device: torch.device) -> dict[str, Any]:
    import transformers

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    return env


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pagedgen.bench.random_weights import random_checkpoint

    device = torch.device(args.device)
    sizes = SMOKE if args.smoke else FULL
    document: dict[str, Any] = {"command": " ".join(sys.argv), "smoke": args.smoke, "dtype": args.dtype}
    document["cuda_graphs"] = not args.no_cuda_graphs
    document["environment"] = environment(device)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        out.write_text(json.dumps(document, indent=2) + "\n")

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pagedgen-gpu-check-") as scratch:
        checkpoint = random_checkpoint(Path(args.config), Path(scratch) / "ckpt", seed=args.seed)
        document["weights"] = {"config": str(args.config), "seed": args.seed}
        _low_precision_sections(checkpoint, device, args, sizes, document, save)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the bf16 models are gone: room for the fp32 pair
        document["fp32_greedy_match"] = _timed(lambda: fp32_match(checkpoint, device, sizes, args.seed))
    document["total_s"] = time.perf_counter() - started
    save()
    return document


def _low_precision_sections(
    checkpoint: Path, device: torch.device, args: argparse.Namespace, sizes: Sizes, document: dict, save: Any
) -> None:
    """Throughput and the decode step in ``args.dtype``; both models are freed on return."""
    import pagedgen as pg
    from pagedgen.bench.baselines import TransformersBaselines

    model = pg.Model(str(checkpoint), dtype=args.dtype, device=str(device))
    hf = TransformersBaselines(checkpoint, device=device, dtype=model.dtype)
    graphs = not args.no_cuda_graphs
    for workload in sizes.workloads:
        document[workload.name] = _timed(lambda w=workload: throughput(model, hf, w, args.seed, graphs))
        save()
    document["decode_step"] = _timed(
        lambda: decode_step(model, sizes.decode_rows, sizes.decode_steps, args.seed, graphs)
    )
    save()


def _timed(section: Any) -> dict[str, Any]:
    """Run one section; its failure is recorded (with the traceback), not raised: the others still run."""
    start = time.perf_counter()
    try:
        result = section()
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=8)}
    result["section_s"] = time.perf_counter() - start
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--device", default="cuda", help="cuda (the check) or cpu (the smoke run)")
    parser.add_argument(
        "--dtype", default="bfloat16", help="dtype of the throughput sections (fp32 check: float32)"
    )
    parser.add_argument(
        "--config", type=Path, default=DEFAULT_CONFIG, help="dir holding the model's config.json"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the prompts")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="EngineConfig(cuda_graphs=False)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to prove the script works (CPU)")
    args = parser.parse_args(argv)
    document = run(args)
    failed = [k for k, v in document.items() if isinstance(v, dict) and "error" in v]
    summary = {
        k: {"pagedgen_tok_s": v["pagedgen"]["tok_s"], "transformers_tok_s": v["transformers_static"]["tok_s"]}
        for k, v in document.items()
        if isinstance(v, dict) and "pagedgen" in v
    }
    print(
        json.dumps({"summary": summary, "failed_sections": failed, "total_s": document["total_s"]}, indent=2)
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
