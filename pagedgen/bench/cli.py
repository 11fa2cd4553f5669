"""``pagedgen bench {throughput,serve,gemm,prefix,guidance,kernels}``: argument parsing and wiring.

``pagedgen/cli.py`` hands ``pagedgen bench ...`` here as ``main(argv)``. Every subcommand prints a readable
report and, with ``--json``, writes the machine-readable one.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pagedgen.argtypes import positive_int
from pagedgen.bench.extras import INSTALL_HINT, MissingBenchExtra, importable, require
from pagedgen.bench.loaded import BenchModel, BenchTokenizer, LoadedModel
from pagedgen.core.json_value import JsonObject

if TYPE_CHECKING:
    from pagedgen.bench.throughput import ThroughputResult
    from pagedgen.bench.workloads import WorkloadSpec
    from pagedgen.models.config import ModelConfig

DEFAULT_BASELINES = ""  # pagedgen alone: a plain run stays within minutes; baselines on request
WORKLOAD_MEANINGS = {
    "W1": "offline batch: every prompt the same length, fixed outputs",
    "W2": "mixed lengths (online-like): prompts and outputs drawn from ranges",
    "B1": "batch 1: one request at a time, the single-stream decode speed",
    "R1": "batch 1, repeat-the-text prompts: where n-gram speculative decoding helps",
    "PP512": "llama-bench's prompt test: 512-token prompts, one token out, batch 1 (prefill speed)",
    "TG128": "llama-bench's generation test: 1-token prompts, 128 tokens out, batch 1 (decode speed)",
}


def _workloads_epilog() -> str:
    from pagedgen.bench.workloads import NAMED_WORKLOADS

    lines = ["named workloads (--workload):"]
    for name, spec in NAMED_WORKLOADS.items():
        lines.append(f"  {name}  {WORKLOAD_MEANINGS.get(name, '')}")
        lines.append(f"      {spec.describe()}")
    return "\n".join(lines)


def _say(line: str) -> None:
    """Progress as it happens, also when stdout is a pipe or a file."""
    print(line, flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedgen bench", description="Benchmarks: offline, online, GEMM.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    epilog = _workloads_epilog()
    raw = argparse.RawDescriptionHelpFormatter
    throughput = sub.add_parser(
        "throughput",
        help="offline throughput of pagedgen (baselines on request)",
        description="Offline throughput: each workload's requests submitted at once. Baselines and the "
        "float32-weights reference run only on request (--baselines, --reference).",
        epilog=epilog,
        formatter_class=raw,
    )
    _throughput_parser(throughput)
    serve = sub.add_parser(
        "serve", help="online latency against a running 'pagedgen serve'", epilog=epilog, formatter_class=raw
    )
    _serve_parser(serve)
    _gemm_parser(sub.add_parser("gemm", help="GEMM backend timings per shape and the table they imply"))
    _prefix_parser(sub.add_parser("prefix", help="TTFT and prefill work with prefix caching off and on"))
    _guidance_parser(sub.add_parser("guidance", help="decode-step cost of JSON-schema constrained decoding"))
    _kernels_parser(
        sub.add_parser("kernels", help="a batch-1 decode forward per kernel, against the roofline")
    )
    return parser


def _kernels_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="'default', a checkpoint dir or a .gguf")
    p.add_argument("--weights", choices=("native", "float32"), default="native")
    _activations_argument(p)
    p.add_argument("--context", type=positive_int, default=100, help="tokens in the cache before the step")
    p.add_argument("--repeats", type=positive_int, default=20, help="forwards per measurement")
    m = p.add_argument_group("machine")
    m.add_argument("--threads", type=positive_int, help="threads of torch and OpenBLAS (default: all CPUs)")
    m.add_argument("--gemm", choices=["auto", "torch", "openblas", "native"], default="auto")
    m.add_argument("--no-bandwidth", action="store_true", help="skip the streaming-bandwidth measurement")
    o = p.add_argument_group("output")
    o.add_argument("--json", type=Path, help="write the profile (and the machine) to this JSON file")
    o.add_argument("--markdown", type=Path, help="write the markdown table to this file")


def cmd_kernels(args: argparse.Namespace) -> int:
    from pagedgen.bench.kernel_profile import (
        format_profile_table,
        measure_stream_bandwidth,
        run_kernel_profile,
    )
    from pagedgen.bench.random_weights import bench_tokenizer
    from pagedgen.bench.report import write_json
    from pagedgen.bench.workloads import text_tokens
    from pagedgen.engine.config import EngineConfig
    from pagedgen.engine.engine import Engine
    from pagedgen.models.model import Model

    _setup_machine(args.threads, args.gemm)
    machine = machine_info(None)
    _print_machine(machine)
    if args.model == "synthetic":
        raise ValueError("the kernel profile needs a decoder with weights; the synthetic model has none")
    model = Model(args.model, weights=args.weights, activations=args.activations)
    Engine(model, EngineConfig(max_batch_size=1)).close()  # the engine's start: the measured GEMM table
    bandwidth = None if args.no_bandwidth else measure_stream_bandwidth()
    tokens = text_tokens(bench_tokenizer(model, model.checkpoint_dir))
    profile, hooked = run_kernel_profile(
        model, args.model, tokens, context=args.context, repeats=args.repeats, bandwidth=bandwidth
    )
    machine["load_average_end"] = list(os.getloadavg())
    table = format_profile_table(profile)
    forwards = ", ".join(
        f"{path} {t['best'] * 1e3:.2f} ms best / {t['median'] * 1e3:.2f} median"
        for path, t in profile.forward_s.items()
    )
    stream = "not measured" if bandwidth is None else f"{bandwidth / 1e9:.1f} GB/s"
    print(
        f"\nbatch-1 decode forward, context {args.context}: {forwards}; hooked per-layer {hooked * 1e3:.2f}ms"
    )
    print(f"streaming read bandwidth: {stream}\n\n{table}")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table + "\n")
    if args.json:
        command = "pagedgen bench " + " ".join(sys.argv[2:] if args.argv is None else args.argv)
        record = profile.to_dict() | {"hooked_forward_ms": hooked * 1e3}
        write_json(args.json, {"command": command, "machine": machine, "profile": record})
    return 0


def _prefix_parser(p: argparse.ArgumentParser) -> None:
    from pagedgen.bench.prefix import WORKLOADS

    p.add_argument("--model", default="default", help="'default', a checkpoint dir, a .gguf, or 'synthetic'")
    p.add_argument("--weights", choices=("native", "float32"), default="native")
    p.add_argument("--workload", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    w = p.add_argument_group("workload")
    w.add_argument("--concurrency", type=positive_int, default=4, help="clients (conversations) in flight")
    w.add_argument("--system-len", type=positive_int, default=1024, help="shared system prompt tokens")
    w.add_argument("--requests", type=positive_int, default=32, help="shared-prompt: questions in all")
    w.add_argument("--turns", type=positive_int, default=4, help="multi-turn: turns per conversation")
    w.add_argument("--question-len", type=positive_int, default=24, help="tokens of each question / turn")
    w.add_argument("--output-len", type=positive_int, default=16, help="tokens generated per request")
    e = p.add_argument_group("pagedgen engine")
    e.add_argument("--max-batch-size", type=positive_int, default=32)
    e.add_argument("--max-scheduled-tokens", type=positive_int, default=2048)
    e.add_argument("--block-size", type=positive_int, default=16)
    e.add_argument("--num-blocks", type=positive_int)
    m = p.add_argument_group("machine")
    m.add_argument("--threads", type=positive_int, help="threads of torch and OpenBLAS (default: all CPUs)")
    m.add_argument("--gemm", choices=["auto", "torch", "openblas", "native"], default="auto")
    o = p.add_argument_group("output")
    o.add_argument("--json", type=Path, help="write both runs of every workload to this JSON file")
    o.add_argument("--markdown", type=Path, help="write the markdown tables to this file")


def _guidance_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="'default', a checkpoint dir, a .gguf, or 'synthetic'")
    p.add_argument("--weights", choices=("native", "float32"), default="native")
    p.add_argument("--batch", type=positive_int, default=16, help="requests decoding together")
    p.add_argument("--output-len", type=positive_int, default=64, help="timed tokens per request")
    p.add_argument("--repeats", type=positive_int, default=3, help="runs of each mode, alternated")
    p.add_argument("--schema", type=Path, help="a JSON schema file (default: 6-8 bounded records)")
    m = p.add_argument_group("machine")
    m.add_argument("--threads", type=positive_int, help="threads of torch and OpenBLAS (default: all CPUs)")
    m.add_argument("--gemm", choices=["auto", "torch", "openblas", "native"], default="auto")
    o = p.add_argument_group("output")
    o.add_argument("--json", type=Path, help="write the result to this JSON file")


def cmd_guidance(args: argparse.Namespace) -> int:
    import json

    from pagedgen.bench.guidance import compare_guidance, markdown_table
    from pagedgen.engine.config import EngineConfig

    _setup_machine(args.threads, args.gemm)
    machine = machine_info(None)
    _print_machine(machine)
    model, tokenizer = _load_one_model(args.model, args.weights)
    schema = None if args.schema is None else json.loads(args.schema.read_text())
    config = EngineConfig(max_batch_size=args.batch)
    result = compare_guidance(
        model,
        tokenizer,
        config,
        batch=args.batch,
        output_len=args.output_len,
        repeats=args.repeats,
        schema=schema,
    )
    machine["load_average_end"] = list(os.getloadavg())
    print("\n" + markdown_table(result))
    if args.json:
        command = "pagedgen bench " + " ".join(sys.argv[2:] if args.argv is None else args.argv)
        document = {"command": command, "machine": machine, "result": result.to_dict()}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    return 0


def _load_one_model(name: str, weights: str) -> tuple[BenchModel, BenchTokenizer]:
    """(model, tokenizer) without the float32 reference copy :func:`_load_model` adds."""
    if name == "synthetic":
        from pagedgen.models.synthetic import SyntheticModel

        model = SyntheticModel()
        return model, model.tokenizer
    from pagedgen.models.model import Model
    from pagedgen.models.tokenizer import Tokenizer

    model = Model(name, weights=weights)
    return model, Tokenizer(model)


def cmd_prefix(args: argparse.Namespace) -> int:
    import json

    from pagedgen.bench.prefix import build_prefix_workload, compare_caching, markdown_table
    from pagedgen.engine.config import EngineConfig

    _setup_machine(args.threads, args.gemm)
    machine = machine_info(None)
    _print_machine(machine)
    model, tokenizer = _load_one_model(args.model, args.weights)
    config = EngineConfig(
        max_batch_size=args.max_batch_size,
        max_scheduled_tokens=args.max_scheduled_tokens,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
    )
    sizes = {
        "concurrency": args.concurrency,
        "system_len": args.system_len,
        "requests": args.requests,
        "turns": args.turns,
        "question_len": args.question_len,
        "output_len": args.output_len,
    }
    warm = build_prefix_workload("shared-prompt", tokenizer, concurrency=2, system_len=64, requests=2)
    compare_caching(model, warm, config, log=lambda _line: None)  # first-call costs stay out of the runs
    comparisons = []
    for name in args.workload:
        workload = build_prefix_workload(name, tokenizer, **sizes)
        print(f"[{name}] {workload.describe()}", flush=True)
        comparisons.append(compare_caching(model, workload, config))
    machine["load_average_end"] = list(os.getloadavg())
    table = markdown_table(comparisons)
    print("\n" + table)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table + "\n")
    if args.json:
        command = "pagedgen bench " + " ".join(sys.argv[2:] if args.argv is None else args.argv)
        document = {
            "command": command,
            "machine": machine,
            "settings": sizes | {"max_batch_size": args.max_batch_size, "block_size": args.block_size},
            "results": [c.to_dict() for c in comparisons],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    return 0 if all(c.identical for c in comparisons) else 1


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 or inf, got {text}")
    return value


def _add_workload_args(p: argparse.ArgumentParser, default: str) -> None:
    g = p.add_argument_group("workload")
    g.add_argument(
        "--workload",
        nargs="+",
        default=None,
        help=f"named workloads: W1 W2 B1 R1 PP512 TG128 (default {default})",
    )
    g.add_argument("--num-prompts", type=positive_int, help="requests of a custom workload (default 64)")
    g.add_argument("--input-len", help="custom workload prompt length: N or LOW:HIGH")
    g.add_argument("--output-len", help="custom workload output length: N or LOW:HIGH")
    g.add_argument("--seed", type=int, default=0, help="seed of the custom workload")


def _activations_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--activations",
        choices=("fp32", "q8"),
        default="fp32",
        help="pagedgen's activations (pg.Model's activations=): fp32, exact (default), or q8, llama.cpp's "
        "8-bit activations with integer dot products (approximate, opt-in)",
    )


def _throughput_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="'default', a checkpoint dir, a .gguf, or 'synthetic'")
    p.add_argument(
        "--weights",
        choices=("native", "float32"),
        default="native",
        help="pagedgen's weight format (default: native)",
    )
    _activations_argument(p)
    p.add_argument(
        "--reference",
        action="store_true",
        help="with native weights, first run pagedgen on float32 weights too (pagedgen-f32w): the fp32 "
        "reference of every match rate (default: pagedgen's own outputs are the reference; a second load "
        "and run)",
    )
    p.add_argument(
        "--device", choices=("cpu", "cuda"), help="where every system runs (default: CUDA if present)"
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="pagedgen's and transformers' dtype (default: float32 on the CPU, bfloat16 on CUDA)",
    )
    p.add_argument(
        "--random-weights",
        type=Path,
        metavar="CONFIG_DIR",
        help="instead of --model: seeded random weights for CONFIG_DIR/config.json (tokenizer files there "
        "are used when present), written to a temporary checkpoint that every system loads",
    )
    p.add_argument("--weights-seed", type=int, default=0, help="seed of --random-weights (default 0)")
    _add_workload_args(p, "W1")
    p.add_argument(
        "--baselines",
        default=DEFAULT_BASELINES,
        help="comma list of hf-static, hf-cb, ort-genai, ort-genai-int4, vllm, vllm-eager, llama.cpp, run in "
        "this order after pagedgen (default: none); the ort-genai ones need the bench extra",
    )
    p.add_argument(
        "--llama-cpp-dir",
        type=Path,
        help="folder of llama.cpp's llama-server and llama-bench (the llama.cpp baseline, on the model's "
        "GGUF file; scripts/build_llama_cpp.sh builds them)",
    )
    p.add_argument(
        "--vllm-venv",
        type=Path,
        help="root of the venv holding vLLM's CPU build (default: this interpreter's environment)",
    )
    e = p.add_argument_group("pagedgen engine")
    e.add_argument("--max-batch-size", type=positive_int, default=32, help="batch size of every system")
    e.add_argument("--max-scheduled-tokens", type=positive_int, default=2048)
    e.add_argument("--block-size", type=positive_int, default=16)
    e.add_argument("--num-blocks", type=positive_int)
    e.add_argument("--chunk-size", type=positive_int)
    e.add_argument(
        "--speculative",
        choices=("ngram",),
        help="also run pagedgen with this draft proposer (pagedgen+ngram) and report the speedup",
    )
    e.add_argument(
        "--num-speculative-tokens", type=positive_int, default=4, help="drafts per step (default 4)"
    )
    e.add_argument("--no-cuda-graphs", action="store_true", help="EngineConfig(cuda_graphs=False) on CUDA")
    m = p.add_argument_group("machine")
    m.add_argument("--threads", type=positive_int, help="threads of torch and OpenBLAS (default: all CPUs)")
    m.add_argument(
        "--gemm",
        choices=["auto", "torch", "openblas", "native"],
        default="auto",
        help="linear-layer backend: auto (the table measured for this machine and model at engine start, "
        "see 'pagedgen bench gemm'), or one backend for every shape (weights kept as stored: native runs "
        "the quant kernel, torch and openblas dequantise + torch GEMM, for every call)",
    )
    m.add_argument("--no-roofline", action="store_true", help="skip the GEMM peak measurement")
    o = p.add_argument_group("output")
    o.add_argument("--profile", action="store_true", help="split pagedgen's step time into phases")
    o.add_argument("--json", type=Path, help="write every record (and the machine) to this JSON file")
    o.add_argument("--markdown", type=Path, help="write the markdown table to this file")
    o.add_argument("--plot", type=Path, help="bar chart PNG (default: next to --json, with matplotlib)")


def _serve_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument("--served-model", help="model id to send (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("PAGEDGEN_API_KEY"), help="bearer token, if required")
    p.add_argument(
        "--tokenizer", default="default", help="model whose tokenizer builds the prompts ('synthetic' too)"
    )
    _add_workload_args(p, "W2")
    p.add_argument(
        "--request-rate", type=_rate, nargs="+", default=[math.inf], help="requests/s (several: one run each)"
    )
    p.add_argument("--max-concurrency", type=positive_int, help="most requests in flight")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--json", type=Path, help="write the summaries to this JSON file")
    p.add_argument(
        "--plot", type=Path, help="latency-vs-rate PNG (default: next to --json, 2+ rates, with matplotlib)"
    )
    a = p.add_argument_group("a long prompt arriving beside running streams (instead of the rate sweep)")
    a.add_argument(
        "--long-prompt-tokens",
        type=positive_int,
        help="send one prompt of this many tokens beside --streams running streams; report their ITL",
    )
    a.add_argument("--streams", type=positive_int, default=2, help="running streams (default 2)")
    a.add_argument(
        "--stream-tokens",
        type=positive_int,
        default=1024,
        help="tokens each stream asks for; closed once the long prompt has its first token (default 1024)",
    )
    a.add_argument("--repeats", type=positive_int, default=1, help="runs per server, interleaved (default 1)")
    a.add_argument(
        "--launch",
        metavar="MODEL",
        help="start one 'pagedgen serve --model MODEL' per --mixed-step-tokens value instead of --base-url",
    )
    a.add_argument(
        "--mixed-step-tokens",
        type=_budget,
        nargs="+",
        default=[2048, None],
        help="the launched servers' --max-mixed-step-tokens; 'default' leaves the server's own (default: "
        "2048 default, i.e. the whole step budget beside decodes, as before, and the device default)",
    )
    a.add_argument("--launch-args", default="", help="more 'pagedgen serve' arguments for launched servers")


def _budget(text: str) -> int | None:
    return None if text == "default" else positive_int(text)


def _gemm_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="model whose linear layers to time")
    p.add_argument(
        "--weights",
        choices=("native", "float32"),
        default="native",
        help="the model's weight format, as the engine would load it (native: the quantized paths are timed)",
    )
    p.add_argument("--max-batch-size", type=positive_int, default=16, help="the engine's (decode widths)")
    p.add_argument("--max-scheduled-tokens", type=positive_int, default=2048, help="the engine's (prefill)")
    p.add_argument("--chunk-size", type=positive_int, help="the engine's prefill chunk, if any")
    p.add_argument("--recalibrate", action="store_true", help="measure again even if a cached table exists")
    p.add_argument("--threads", type=positive_int, help="threads of torch and OpenBLAS (default: all CPUs)")
    p.add_argument("--shapes", action="store_true", help="also time each shape alone at --rows")
    p.add_argument("--rows", default="1,4,8,16,32,64,128,256", help="comma list of row counts (--shapes)")
    p.add_argument("--trials", type=positive_int, default=5, help="repeats per shape (--shapes)")
    p.add_argument("--json", type=Path)


def workloads_from_args(args: argparse.Namespace, default: str) -> list[WorkloadSpec]:
    """Named workloads plus, if any length flag is given, a ``custom`` one. Raises ValueError on bad input."""
    from pagedgen.bench.workloads import LengthRange, WorkloadSpec, workload_by_name

    custom = args.input_len is not None or args.output_len is not None or args.num_prompts is not None
    names = args.workload if args.workload is not None else ([] if custom else [default])
    specs = [workload_by_name(n) for n in names]
    if custom:
        specs.append(
            WorkloadSpec(
                "custom",
                args.num_prompts or 64,
                LengthRange.parse(args.input_len or "100"),
                LengthRange.parse(args.output_len or "128"),
                seed=args.seed,
            )
        )
    return specs


def machine_info(peak_flops: float | None) -> JsonObject:
    """What a reader needs to interpret the numbers: CPU and flags, threads, versions, GEMM table, load."""
    import numpy as np
    import torch

    from pagedgen.bench.cpu import cpu_flags
    from pagedgen.ops.kernels.cpu_info import cpu_model
    from pagedgen.ops.kernels.native import kernel_march
    from pagedgen.ops.matmul.gemm import active_table
    from pagedgen.ops.matmul.gemm_threads import current_thread_settings

    threads = current_thread_settings()
    return {
        "cpu": cpu_model(),
        "cpu_flags": list(cpu_flags()),
        "kernel_march": kernel_march(),
        "cpus": threads.cpus,
        "torch_threads": threads.torch_threads,
        "blas_threads": threads.blas_threads,
        "blas_core": threads.blas_core,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "gemm_table": active_table().describe(),
        "gemm_peak_gflops": None if peak_flops is None else peak_flops / 1e9,
        "load_average": list(os.getloadavg()),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _setup_machine(threads: int | None, gemm: str) -> None:
    from pagedgen.ops.matmul import gemm as gemm_mod
    from pagedgen.ops.matmul import gemm_tune, quant_table
    from pagedgen.ops.matmul.gemm_threads import configure_cpu_threads

    configure_cpu_threads(threads)
    if gemm == "auto":  # measured (or read from the cache) when the engine starts
        gemm_mod.set_gemm_table(gemm_mod.UNTUNED, pinned=False)
        quant_table.set_quant_table(quant_table.UNCALIBRATED, pinned=False)
    else:  # weights kept as stored: the quant kernel for native, dequantise + torch GEMM otherwise
        gemm_mod.set_gemm_table(gemm_tune.FIXED_TABLES[gemm])
        quant_table.set_quant_table(gemm_tune.FIXED_QUANT_TABLES[gemm])


def _load_model(
    name: str,
    weights: str = "native",
    *,
    device: str | None = None,
    dtype: str | None = None,
    random_weights: Path | None = None,
    weights_seed: int = 0,
    scratch: Path | None = None,
    reference: bool = False,
    activations: str = "fp32",
) -> LoadedModel:
    """(model, tokenizer, checkpoint dir for the baselines, float32-weights reference model or None).

    ``synthetic`` is the weightless test model. With ``reference`` and the model running its weights as
    stored (native), the same checkpoint is also loaded on float32 weights: that run is the fp32 reference of
    every match rate (exact activations: the fp32 model whatever ``activations`` pagedgen runs with).
    ``random_weights`` (a config dir) replaces ``name``: its checkpoint is written under ``scratch``
    (:mod:`pagedgen.bench.random_weights`).
    """
    if random_weights is None and name == "synthetic":
        from pagedgen.models.synthetic import SyntheticModel

        synthetic = SyntheticModel()
        return LoadedModel(synthetic, synthetic.tokenizer, None, None)
    from pagedgen.bench.random_weights import bench_tokenizer, random_checkpoint
    from pagedgen.models.model import Model

    source: str | Path = name
    if random_weights is not None:
        if scratch is None:
            raise ValueError("--random-weights needs a scratch directory for its checkpoint")
        source = random_checkpoint(random_weights, scratch / "random-checkpoint", seed=weights_seed)
    model = Model(source, dtype=dtype, device=device, weights=weights, activations=activations)
    native = getattr(model.weights_format, "value", "float32") != "float32"
    f32 = Model(source, dtype=dtype, device=device, weights="float32") if native and reference else None
    return LoadedModel(model, bench_tokenizer(model, model.checkpoint_dir), model.checkpoint_dir, f32)


def cmd_throughput(args: argparse.Namespace) -> int:
    import tempfile

    from pagedgen.bench.roofline import measure_gemm_flops
    from pagedgen.bench.throughput import ThroughputResult

    specs = workloads_from_args(args, "W1")
    names = [n.strip() for n in args.baselines.split(",") if n.strip()]
    plot = _plot_path(args.plot, args.json, "the throughput chart")
    _setup_machine(args.threads, args.gemm)
    on_cpu = args.device == "cpu" or (args.device is None and not _cuda_available())
    if not args.no_roofline and on_cpu:
        _say("measuring the fp32 GEMM peak (--no-roofline skips it) ...")
    peak = None if args.no_roofline or not on_cpu else measure_gemm_flops()  # a CPU GEMM roofline
    result = ThroughputResult(machine=machine_info(peak))
    _print_machine(result.machine)
    with tempfile.TemporaryDirectory(prefix="pagedgen-bench-") as scratch:  # a random checkpoint lives here
        reference = " and its float32-weights reference" if args.reference else ""
        q8 = ", q8 activations" if args.activations == "q8" else ""
        _say(f"loading {args.random_weights or args.model!s} ({args.weights} weights{q8}){reference} ...")
        loaded = _load_model(
            args.model,
            args.weights,
            device=args.device,
            dtype=args.dtype,
            random_weights=args.random_weights,
            weights_seed=args.weights_seed,
            scratch=Path(scratch),
            reference=args.reference,
            activations=args.activations,
        )
        result.machine.update(device_info(loaded[0]))
        return _throughput_runs(args, specs, names, plot, peak, result, loaded)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def device_info(model: BenchModel) -> JsonObject:
    """The device, dtype and weights the systems ran with (the GPU's name on CUDA)."""
    import torch

    device = torch.device(getattr(model, "device", "cpu"))
    info: JsonObject = {
        "device": str(device),
        "dtype": str(getattr(model, "dtype", "")).removeprefix("torch."),
        "activations": getattr(model, "activations", "fp32"),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def _throughput_runs(
    args: argparse.Namespace,
    specs: list[WorkloadSpec],
    names: list[str],
    plot: Path | None,
    peak: float | None,
    result: ThroughputResult,
    loaded: LoadedModel,
) -> int:
    """Every workload on pagedgen and the baselines, then the report (``loaded``: :func:`_load_model`'s)."""
    from pagedgen.bench.baselines import baseline_runners
    from pagedgen.bench.profile import format_profile
    from pagedgen.bench.report import json_document, markdown_table, plot_throughput, write_json
    from pagedgen.bench.throughput import PagedgenOptions, bench_workload

    model, tokenizer, checkpoint, reference_model = loaded
    threads = result.machine["torch_threads"]
    runners = baseline_runners(
        names,
        checkpoint,
        vllm_venv=args.vllm_venv,
        llama_cpp_dir=args.llama_cpp_dir,
        threads=threads,
        device=getattr(model, "device", None),
        dtype=getattr(model, "dtype", None),
    )
    options = PagedgenOptions(
        max_batch_size=args.max_batch_size,
        max_scheduled_tokens=args.max_scheduled_tokens,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        chunk_size=args.chunk_size,
        speculative=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
        cuda_graphs=not args.no_cuda_graphs,
    )
    for spec in specs:
        bench_workload(
            spec,
            model,
            tokenizer,
            options,
            runners,
            peak_flops=peak,
            profile=args.profile,
            result=result,
            log=_say,
            reference_model=reference_model,
        )
    if "llama.cpp" in names:
        result.peers["llama-bench"] = _llama_bench(args.llama_cpp_dir, checkpoint, threads)
    result.machine["load_average_end"] = list(os.getloadavg())
    table = markdown_table(result.records)
    print("\n" + table)
    for name, summary in result.profiles.items():
        print("\n" + format_profile(f"profile {name}", summary))
    command = "pagedgen bench " + " ".join(sys.argv[2:] if args.argv is None else args.argv)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table + "\n")
    if args.json:
        profiles = {k: v.to_dict() for k, v in result.profiles.items()}
        write_json(
            args.json,
            json_document(
                result.records, command=command, machine=result.machine, profiles=profiles, peers=result.peers
            ),
        )
    if plot is not None and plot_throughput(result.records, plot):
        print(f"\nchart: {plot}")
    return 0


def _llama_bench(directory: Path | None, checkpoint: Path | None, threads: int) -> JsonObject:
    """llama-bench's pp512 / tg128 on the same file and threads (printed), or why it did not run."""
    from pagedgen.bench.llama_cpp import llama_bench
    from pagedgen.bench.records import SystemSkipped

    try:
        found = llama_bench(directory, checkpoint, threads)
    except SystemSkipped as skip:
        print(f"\nllama-bench: skipped: {skip}", flush=True)
        return {"status": "skipped", "reason": str(skip)}
    except (RuntimeError, ValueError) as exc:
        print(f"\nllama-bench: failed: {exc}", flush=True)
        return {"status": "failed", "reason": str(exc)}
    figures = found["figures"].items()
    rates = ", ".join(f"{t} {f['tokens_per_s']:.1f} ± {f['stddev']:.1f} tok/s" for t, f in figures)
    print(f"\nllama-bench ({threads} threads, same file): {rates}", flush=True)
    for key, row in found.get("batched", {}).get("figures", {}).items():
        print(
            f"llama-batched-bench {key}: {row['pp']:.0f} + {row['tg']:.0f} tokens, "
            f"{row['out_tokens_per_s']:.1f} out tok/s (tg {row['speed_tg']:.1f} tok/s)",
            flush=True,
        )
    return {"status": "ok", **found}


def _plot_path(explicit: Path | None, json_path: Path | None, purpose: str) -> Path | None:
    """Where the chart goes: ``--plot``, else next to ``--json`` when matplotlib is installed.

    Checked before any measurement: an explicit ``--plot`` without matplotlib raises MissingBenchExtra.
    """
    if explicit is not None:
        require("matplotlib", purpose)
        return explicit
    if json_path is None:
        return None
    if not importable("matplotlib"):
        print(f"no chart: matplotlib is not installed ({INSTALL_HINT})", flush=True)
        return None
    return json_path.with_suffix(".png")


def _print_machine(machine: JsonObject) -> None:
    peak = machine["gemm_peak_gflops"]
    print(
        f"{machine['cpu']}: {machine['cpus']} CPUs, kernels -march={machine['kernel_march']}, "
        f"torch {machine['torch_threads']} threads, OpenBLAS "
        f"{machine['blas_threads']} threads ({machine['blas_core']}); GEMM table: {machine['gemm_table']}; "
        f"fp32 GEMM peak {'—' if peak is None else f'{peak:.1f} GFLOP/s'}; load {machine['load_average']}",
        flush=True,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from pagedgen.bench.report import write_json
    from pagedgen.bench.serve import format_summary, plot_latency_vs_rate, run_rate, served_model_name
    from pagedgen.bench.workloads import build_workload
    from pagedgen.models.synthetic import SyntheticModel
    from pagedgen.models.tokenizer import Tokenizer

    require("httpx", "pagedgen bench serve")
    if args.long_prompt_tokens is not None:
        return cmd_serve_arrival(args)
    specs = workloads_from_args(args, "W2")
    plot = _plot_path(args.plot, args.json, "the latency chart")
    tokenizer = SyntheticModel().tokenizer if args.tokenizer == "synthetic" else Tokenizer(args.tokenizer)
    model = args.served_model or asyncio.run(served_model_name(args.base_url, args.api_key))
    summaries = []
    for spec in specs:
        requests = build_workload(spec, tokenizer)
        for rate in args.request_rate:
            summary = asyncio.run(
                run_rate(
                    args.base_url,
                    model,
                    requests,
                    rate,
                    args.max_concurrency,
                    api_key=args.api_key,
                    seed=args.seed,
                    timeout_s=args.timeout,
                )
            )
            summaries.append((spec.name, summary))
            print(f"[{spec.name}] " + format_summary(summary), flush=True)
    if args.json:
        records = [{"workload": name, **s.to_dict()} for name, s in summaries]
        write_json(args.json, {"base_url": args.base_url, "model": model, "summaries": records})
    if plot is not None and plot_latency_vs_rate([s for _, s in summaries], plot):
        print(f"\nchart: {plot}")
    return 0 if all(s.failed == 0 for _, s in summaries) else 1


def cmd_serve_arrival(args: argparse.Namespace) -> int:
    """The long-prompt scenario (:mod:`pagedgen.bench.arrival`) against ``--base-url`` or, with
    ``--launch``, against one launched server per ``--mixed-step-tokens`` value, runs interleaved."""
    import shlex

    from pagedgen.bench.arrival import arrival_table, format_arrival, run_arrival
    from pagedgen.bench.launch import free_port, launch, serve_command
    from pagedgen.bench.report import write_json
    from pagedgen.bench.serve import served_model_name
    from pagedgen.bench.workloads import LengthRange, WorkloadSpec, build_workload
    from pagedgen.models.synthetic import SyntheticModel
    from pagedgen.models.tokenizer import Tokenizer

    tokenizer = SyntheticModel().tokenizer if args.tokenizer == "synthetic" else Tokenizer(args.tokenizer)
    launched = []
    try:
        if args.launch:
            for budget in args.mixed_step_tokens:
                label = f"max_mixed_step_tokens {'default' if budget is None else budget}"
                port = free_port()
                command = serve_command(args.launch, port, budget, shlex.split(args.launch_args))
                launched.append(launch(label, command, port, args.timeout))
            targets = [(server.label, server.url, None) for server in launched]
        else:
            targets = [(args.base_url, args.base_url, args.api_key)]
        records, summaries = [], []
        for rep in range(args.repeats):
            # Fresh prompts every repeat (a server's prefix cache must not serve a later run); the same
            # prompts for every server within one.
            out = LengthRange(args.stream_tokens, args.stream_tokens)
            stream_spec = WorkloadSpec(
                "streams", args.streams, LengthRange(64, 64), out, seed=args.seed + rep
            )
            n = args.long_prompt_tokens
            long_spec = WorkloadSpec(
                "long", 1, LengthRange(n, n), LengthRange(1, 1), seed=args.seed + 1000 + rep
            )
            streams = build_workload(stream_spec, tokenizer)
            long_request = build_workload(long_spec, tokenizer)[0]
            for label, url, key in targets if rep % 2 == 0 else targets[::-1]:
                model = args.served_model or asyncio.run(served_model_name(url, key))
                summary = asyncio.run(
                    run_arrival(
                        url, model, streams, long_request, label=label, api_key=key, timeout_s=args.timeout
                    )
                )
                load = os.getloadavg()
                print(format_arrival(summary) + f"\n  load average {load[0]:.2f} {load[1]:.2f}", flush=True)
                summaries.append(summary)
                records.append({"repeat": rep, "load_average": list(load), **summary.to_dict()})
    finally:
        for server in launched:
            server.stop()
    print("\n" + arrival_table(summaries))
    if args.json:
        write_json(args.json, {"scenario": "long prompt arrival", "runs": records})
    return 0 if all(not s.errors for s in summaries) else 1


def cmd_gemm(args: argparse.Namespace) -> int:
    """The tables the engine would use on this machine for this model (fp32 backends and, for weights kept
    as stored, the quantized paths), each choice's reason, and (with ``--shapes``) the per-shape study."""
    from pagedgen.bench.report import write_json
    from pagedgen.models.llama import Linear
    from pagedgen.models.model import Model
    from pagedgen.ops.kernels.cpu_info import cpu_features, cpu_model
    from pagedgen.ops.kernels.cpu_memory import retain_freed_cpu_memory
    from pagedgen.ops.kernels.native import gemm_kernel, native_status
    from pagedgen.ops.matmul.gemm_calibrate import engine_row_counts, model_linear_weights
    from pagedgen.ops.matmul.gemm_threads import configure_cpu_threads
    from pagedgen.ops.matmul.gemm_tune import cache_dir, calibrate, key_digest
    from pagedgen.ops.matmul.quant_calibrate import model_quant_weights
    from pagedgen.ops.matmul.quant_gemm import quant_kernels

    settings = configure_cpu_threads(args.threads)
    # As the engine's runner does before it calibrates: the dequantise path's fp32 temporaries are reused,
    # not page-faulted again on every call.
    retain_freed_cpu_memory()
    print(f"{cpu_model()}: {', '.join(cpu_features()) or 'no SIMD features listed'}")
    print(f"threads: torch {settings.torch_threads}, OpenBLAS {settings.blas_threads} ({settings.blas_core})")
    kernel = gemm_kernel()
    model = Model(args.model, dtype="float32", device="cpu", weights=args.weights)
    weights = model_linear_weights(model.runtime, (Linear,))
    quant_weights = model_quant_weights(model.runtime, (Linear,)) if quant_kernels() is not None else []
    in_sizes = sorted({w.shape[0] for w in weights})
    variants = ", ".join(f"k={k}: {kernel.variant(k)}" for k in in_sizes) if kernel else None
    print(f"native kernel: {variants or native_status().detail}")
    if not weights and not quant_weights:
        print("nothing to calibrate: the model has no CPU fp32 linear layers and no quantized ones")
        return 0
    counts = engine_row_counts(args.max_batch_size, args.max_scheduled_tokens, args.chunk_size)
    start = time.perf_counter()
    calibration = calibrate(weights, counts, quant_weights=quant_weights, refresh=args.recalibrate)
    path = cache_dir() / f"table-{key_digest(calibration.key or {})}.json"
    print(f"\n{calibration.source} in {time.perf_counter() - start:.1f} s (entry {path})")
    if calibration.table is not None:
        print(f"table: {calibration.table.describe()}")
        print("\n".join(f"  {line}" for line in calibration.reasons))
    if calibration.quant is not None:
        print(f"quantized table: {calibration.quant.describe()}")
        print("\n".join(f"  {line}" for line in calibration.quant_reasons))
    document = {"cpu": cpu_model(), "cpu_features": list(cpu_features()), "native_variants": variants}
    document["calibration"] = calibration.to_json()
    if args.shapes:
        document["shapes"] = _gemm_shapes(args, model.config)
    if args.json:
        write_json(args.json, document)
    return 0


def _gemm_shapes(args: argparse.Namespace, config: ModelConfig) -> JsonObject:
    """Each linear shape alone, DRAM-resident random weights, at ``--rows`` (the per-shape study)."""
    from pagedgen.ops.matmul.gemm_calibrate import (
        available_backends,
        check_equivalence,
        derive_table,
        model_linear_shapes,
        time_shape,
    )
    from pagedgen.ops.matmul.gemm_threads import torch_pool

    rows = [int(r) for r in args.rows.split(",") if r.strip()]
    backends = list(available_backends())
    names = [b.value for b in backends]
    print("\n| in -> out | rows | " + " | ".join(f"{n} GFLOP/s" for n in names) + " | fastest |")
    print("|---|---|" + "---|" * (len(names) + 1))
    timings = []
    for in_f, out_f in model_linear_shapes(config):
        for r in rows:
            t = time_shape(r, in_f, out_f, trials=args.trials)
            timings.append(t)
            rates = " | ".join(f"{t.gflops(b):.1f}" for b in backends)
            print(f"| {in_f} -> {out_f} | {r} | {rates} | {t.fastest.value} |", flush=True)
    torch_pool.restore()
    table = derive_table(timings)
    worst = max(check_equivalence(r, i, o) for i, o in model_linear_shapes(config) for r in (1, 64))
    print(f"\nper-shape table: {table.describe()}\nmax relative difference between backends: {worst:.2e}")
    return {
        "derived_table": table.describe(),
        "max_relative_difference": worst,
        "timings": [
            {"rows": t.rows, "in": t.in_features, "out": t.out_features}
            | {f"{b.value}_gflops": t.gflops(b) for b in t.seconds}
            for t in timings
        ],
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``pagedgen bench``; returns the exit status (2 for a usage error)."""
    parser = build_parser()
    args = parser.parse_args(None if argv is None else list(argv))
    args.argv = None if argv is None else list(argv)
    handlers = {
        "throughput": cmd_throughput,
        "serve": cmd_serve,
        "gemm": cmd_gemm,
        "prefix": cmd_prefix,
        "guidance": cmd_guidance,
        "kernels": cmd_kernels,
    }
    try:
        return handlers[args.command](args)
    except ValueError as exc:
        print(f"pagedgen bench {args.command}: {exc}", file=sys.stderr)
        return 2
    except MissingBenchExtra as exc:
        print(f"pagedgen bench {args.command}: {exc}", file=sys.stderr)
        return 1
