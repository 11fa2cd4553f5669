"""The ``pagedgen`` command: ``serve`` (OpenAI-compatible server), ``generate``, ``chat`` and ``bench``.

Heavy imports (torch, the model code, FastAPI) happen inside the subcommands, so ``pagedgen --help`` is quick.
``pagedgen bench ...`` is handed whole to ``pagedgen.bench.cli:main(argv)`` when that module exists.

A user's mistake (a wrong model path, a bad file, a busy port, an unknown flag) ends the command with one line
on stderr and exit status 2, never a traceback: pagedgen's own errors (:class:`pagedgen.errors.PagedGenError`)
name the problem already, so the traceback would only bury it. ``--debug`` shows it anyway.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING

from pagedgen.argtypes import positive_int

if TYPE_CHECKING:
    import torch
    from fastapi import FastAPI

    from pagedgen.engine.config import EngineConfig
    from pagedgen.llm import ChatSession, CompletionOutput, SamplingParams
    from pagedgen.models.model import Model
    from pagedgen.server.app import ServerOptions
    from pagedgen.server.worker import EngineSnapshot

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
USAGE_ERROR = 2  # argparse's exit status for a bad command line; also every other user mistake


class UsageError(Exception):
    """A mistake on the command line found after parsing (a busy port): one line, exit status 2."""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pagedgen")
    except PackageNotFoundError:  # run from a source tree that was never installed
        from pagedgen import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedgen", description="Continuous-batching LLM inference over a paged KV cache."
    )
    parser.add_argument("--version", action="version", version=f"pagedgen {_version()}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # argparse hands a subcommand's unknown flags up to the top-level parser, whose usage does not list them:
    # main() reports them with the subcommand's own usage instead.
    parser.subcommands = {}  # type: ignore[attr-defined]

    serve = _subcommand(parser, sub, "serve", help="run the OpenAI-compatible HTTP server")
    _add_model_args(serve)
    serve.add_argument("--host", default=DEFAULT_HOST, help=f"bind address (default {DEFAULT_HOST})")
    serve.add_argument("--port", type=_port, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    serve.add_argument(
        "--api-key",
        default=os.environ.get("PAGEDGEN_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $PAGEDGEN_API_KEY, else no key)",
    )
    serve.add_argument(
        "--served-model-name", help="model id clients send and /v1/models lists (default: --model)"
    )
    serve.add_argument("--max-body-bytes", type=positive_int, default=4 << 20, help="request body limit")
    serve.add_argument(
        "--max-queued-requests",
        type=_non_negative_int,
        default=256,  # admission.DEFAULT_MAX_QUEUED_REQUESTS, not imported so that --help stays quick
        help="requests that may wait beyond a full batch (--max-batch-size running); past that, 429 "
        "with Retry-After (default 256)",
    )
    serve.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    _add_connection_args(serve)
    _add_response_store_args(serve)
    _add_engine_args(serve)
    _add_speculative_args(serve)
    _add_content_args(serve)
    _add_reasoning_args(serve)
    _add_tool_args(serve)
    _add_replica_args(serve)

    generate = _subcommand(parser, sub, "generate", help="complete prompts offline and print the completions")
    generate.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt text (one completion each)")
    _add_model_args(generate)
    generate.add_argument(
        "--chat", action="store_true", help="wrap each prompt as a user message (chat template)"
    )
    generate.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    _add_sampling_args(generate, default_max_tokens=64)
    _add_engine_args(generate)
    _add_speculative_args(generate)
    _add_content_args(generate)

    chat = _subcommand(parser, sub, "chat", help="interactive chat: one multi-turn request, streamed replies")
    _add_model_args(chat)
    chat.add_argument("--system", help="system message")
    chat.add_argument("--stats", action="store_true", help="print token counts after every reply")
    _add_sampling_args(chat, default_max_tokens=512)
    _add_engine_args(chat)
    _add_speculative_args(chat)
    _add_content_args(chat)

    sub.add_parser("bench", help="benchmarks (see 'pagedgen bench --help')", add_help=False)
    return parser


def _subcommand(
    parser: argparse.ArgumentParser,
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    *,
    help: str,
) -> argparse.ArgumentParser:
    command = sub.add_parser(name, help=help, description=help)
    # SUPPRESS: without the flag the subcommand leaves the top level's --debug as it was.
    command.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of an error"
    )
    parser.subcommands[name] = command  # type: ignore[attr-defined]
    return command


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {text}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _origins(text: str) -> tuple[str, ...]:
    from pagedgen.server.cors import parse_allowed_origins

    try:
        return parse_allowed_origins(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _reasoning_parser(name: str | None) -> str | None:
    """``--reasoning-parser``, checked after parsing: an unknown name is one line and exit status 2."""
    from pagedgen.server.reasoning import reasoning_parser

    if name is None:
        return None
    try:
        return reasoning_parser(name).name
    except ValueError as exc:
        raise UsageError(f"--reasoning-parser: {exc}") from None


def _add_reasoning_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--reasoning-parser",
        default=None,
        metavar="NAME",
        help="split a reasoning model's <think>...</think> from its answer into message.reasoning_content "
        "(and reasoning): deepseek_r1, qwen3 or think (default: none, all text is content)",
    )


def _non_negative_seconds(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a non-negative number of seconds, got {text}")
    return value


def _add_replica_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("replicas (Ray Serve; needs the ray extra, docs/replicas.md)")
    group.add_argument(
        "--replicas",
        type=positive_int,
        help="serve N engine replicas behind Ray Serve with cache-affinity routing (default: one engine, "
        "no Ray)",
    )
    group.add_argument("--ray-address", help="join this Ray cluster (auto, or HOST:PORT); default: start one")
    group.add_argument(
        "--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves for each replica (default 1)"
    )
    group.add_argument(
        "--autoscaling-config",
        metavar="JSON",
        help="Serve's autoscaling fields as a JSON object (min_replicas, max_replicas, ...); replaces the "
        "fixed --replicas count",
    )


def _add_connection_args(parser: argparse.ArgumentParser) -> None:
    # The defaults are pagedgen.server.lifecycle's and guard's, not imported so that --help stays quick.
    group = parser.add_argument_group("connections and shutdown")
    group.add_argument(
        "--shutdown-timeout",
        type=_non_negative_seconds,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds the requests in flight may take to finish; then streams end with an "
        "error event and [DONE], other requests with a 503 (default 30)",
    )
    group.add_argument(
        "--header-timeout",
        type=_seconds,
        default=10.0,
        help="seconds a request line and headers may take to arrive; past that 408 (default 10)",
    )
    group.add_argument(
        "--body-timeout",
        type=_seconds,
        default=30.0,
        help="seconds a whole request body may take to arrive; past that 408 (default 30)",
    )
    group.add_argument(
        "--keep-alive-timeout",
        type=_seconds,
        default=5.0,
        help="seconds an idle kept-alive connection stays open between requests (default 5)",
    )
    group.add_argument("--no-docs", action="store_true", help="serve no /docs, /redoc or /openapi.json (404)")
    group.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a Host name to accept besides localhost and loopback addresses (repeatable). The Host check is "
        "on for a loopback bind without --api-key, and whenever a name is given",
    )
    group.add_argument(
        "--allowed-origins",
        type=_origins,
        default=(),
        metavar="URL[,URL]",
        help="web origins (scheme://host[:port], or '*' for any) whose browser pages may call the API: CORS "
        "headers and preflight answers for them (default: none, no CORS)",
    )


def _add_response_store_args(parser: argparse.ArgumentParser) -> None:
    # The defaults are pagedgen.server.responses_api.store's, not imported so that --help stays quick.
    group = parser.add_argument_group("stored responses (/v1/responses, previous_response_id)")
    group.add_argument(
        "--responses-max-stored",
        type=_non_negative_int,
        default=1000,
        help="responses kept for previous_response_id and GET, least recently used evicted first "
        "(default 1000; 0 stores none)",
    )
    group.add_argument(
        "--responses-max-bytes",
        type=_non_negative_int,
        default=64 << 20,
        help="bytes of JSON the stored responses and their conversations may take (default 64 MiB)",
    )
    group.add_argument(
        "--responses-max-age",
        type=_seconds,
        default=3600.0,
        help="seconds a stored response is kept (default 3600)",
    )


def _add_tool_args(parser: argparse.ArgumentParser) -> None:
    # The names are pagedgen.server.tool_parsers.TOOL_CALL_PARSERS, not imported so that --help stays quick.
    group = parser.add_argument_group("tool calls")
    group.add_argument(
        "--enable-auto-tool-choice",
        action=argparse.BooleanOptionalAction,
        default=True,
        help='serve tool_choice "auto" (and tools without tool_choice): the model answers in text or calls '
        "tools, each call constrained to a tool and its schema once opened (default: on; "
        '--no-enable-auto-tool-choice makes "auto" a 400, as vLLM without the flag)',
    )
    group.add_argument(
        "--tool-call-parser",
        choices=("hermes", "llama3_json", "mistral"),
        help="the format the model writes tool calls in (default: detected from the chat template; hermes, "
        "with the tools in a system prompt, for a template without tools)",
    )


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="default",
        help="'default' (embedded SmolLM2-135M-Instruct), an HF checkpoint directory or a .gguf file",
    )
    parser.add_argument(
        "--weights",
        choices=("native", "float32"),
        default="native",
        help="'native' keeps GGUF-quantised and 16-bit weights as stored (falls back to float32 without the "
        "native kernels); 'float32' dequantises them at load (default: native)",
    )


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--max-batch-size", type=positive_int, default=16, help="rows per step and resident requests"
    )
    group.add_argument(
        "--max-scheduled-tokens", type=positive_int, default=2048, help="query tokens per step"
    )
    group.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV-cache block")
    group.add_argument("--num-blocks", type=positive_int, help="KV-cache blocks (default: from memory)")
    group.add_argument("--kv-cache-memory-bytes", type=positive_int, help="KV-cache budget in bytes")
    group.add_argument(
        "--chunk-size", type=positive_int, help="largest prefill chunk of one request per step"
    )
    group.add_argument(
        "--max-mixed-step-tokens",
        type=positive_int,
        help="query tokens of a step beside running streams, so a long prompt cannot stall them "
        "(default: 512 on the CPU, --max-scheduled-tokens on a GPU)",
    )
    group.add_argument("--static-batching", action="store_true", help="use the static batching path")
    group.add_argument(
        "--tensor-parallel-size",
        type=positive_int,
        default=1,
        help="split the model over this many ranks (gloo on the CPU, NCCL on CUDA; Llama family only; "
        "default 1)",
    )
    group.add_argument(
        "--tensor-parallel-launcher",
        choices=("local", "ray"),  # EngineConfig checks them too
        default="local",
        help="start ranks 1..T-1 as local processes (default) or as Ray actors in a placement group "
        "(RAY_ADDRESS joins an existing cluster; docs/tensor-parallel.md)",
    )
    group.add_argument(
        "--tensor-parallel-placement",
        choices=("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"),
        default="STRICT_PACK",
        help="the Ray placement group's strategy: STRICT_PACK keeps every rank on this node (default), "
        "SPREAD lets them use other machines",
    )


def _add_content_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--parse-special-in-content",
        action="store_true",
        help="read special-token strings (<|im_end|>, ...) in prompts and messages as special tokens "
        "(default: they are plain text; only the chat template's markup writes special tokens)",
    )


def _add_speculative_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("speculative decoding")
    group.add_argument(
        "--speculative",
        choices=("ngram",),
        help="propose draft tokens for the engine to verify: 'ngram' looks them up in the request's own "
        "context (output unchanged; faster when the output repeats the context)",
    )
    group.add_argument(
        "--num-speculative-tokens",
        type=positive_int,
        default=4,
        help="most draft tokens per request and step (default 4; at most the engine's max_draft_tokens, 8)",
    )


def _add_sampling_args(parser: argparse.ArgumentParser, default_max_tokens: int) -> None:
    group = parser.add_argument_group("sampling (greedy unless --temperature > 0)")
    group.add_argument("--max-tokens", type=positive_int, default=default_max_tokens, help="tokens per reply")
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--seed", type=int)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--presence-penalty", type=float, default=0.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    from pagedgen.engine.config import EngineConfig

    return EngineConfig(
        max_batch_size=args.max_batch_size,
        max_scheduled_tokens=args.max_scheduled_tokens,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        chunk_size=args.chunk_size,
        max_mixed_step_tokens=args.max_mixed_step_tokens,
        dynamic_batching=not args.static_batching,
        tensor_parallel_size=args.tensor_parallel_size,
        tensor_parallel_launcher=args.tensor_parallel_launcher,
        tensor_parallel_placement=args.tensor_parallel_placement,
    )


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    from pagedgen.llm import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )


def _load_model(name: str, weights: str = "native") -> Model:
    from pagedgen.models.model import Model

    print(f"loading model {name!r} ({weights} weights) ...", file=sys.stderr, flush=True)
    return Model(name, weights=weights)


# ---------------------------------------------------------------- subcommands


def server_options(args: argparse.Namespace) -> ServerOptions:
    from pagedgen.server.app import ServerOptions
    from pagedgen.server.guard import host_allow_list
    from pagedgen.server.responses_api.store import StoreLimits

    api_key = args.api_key or None
    return ServerOptions(
        model_name=args.served_model_name or args.model,
        api_key=api_key,
        max_body_bytes=args.max_body_bytes,
        max_queued_requests=args.max_queued_requests,
        speculative=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
        shutdown_timeout=args.shutdown_timeout,
        keep_alive_timeout=args.keep_alive_timeout,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        docs=not args.no_docs,
        allowed_hosts=host_allow_list(args.host, api_key, args.allowed_host),
        parse_special_in_content=args.parse_special_in_content,
        allowed_origins=args.allowed_origins,
        reasoning_parser=_reasoning_parser(args.reasoning_parser),
        response_store=StoreLimits(
            args.responses_max_stored, args.responses_max_bytes, args.responses_max_age
        ),
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from pagedgen.server.app import build_app
    from pagedgen.server.lifecycle import build_server

    if args.replicas is None and (args.ray_address is not None or args.autoscaling_config is not None):
        raise UsageError("--ray-address and --autoscaling-config need --replicas N")
    # Before the model loads: a bad option or a busy port fails in a second, not after minutes of loading.
    options = server_options(args)
    check_port_free(args.host, args.port)
    _log_to_stderr(args.log_level)
    if args.replicas is not None:
        return _serve_replicas(args, options)
    model = _load_model(args.model, args.weights)
    config = engine_config(args)
    app = build_app(model, config, options)
    _announce_on_startup(app, lambda: startup_lines(model, config, options, app.state.worker.snapshot))
    server = build_server(app, host=args.host, port=args.port, log_level=args.log_level)
    server.run()
    return 0 if server.started else 3  # 3: uvicorn's startup failure (it logged why)


def _serve_replicas(args: argparse.Namespace, options: ServerOptions) -> int:
    """``--replicas N``: the same options and engine configuration, served by Ray Serve."""
    try:
        from pagedgen.server.replicas.launch import serve_replicas
        from pagedgen.server.replicas.setup import ModelSource, ReplicaSetup, parse_autoscaling
    except ImportError as exc:
        raise UsageError(f"--replicas needs Ray Serve: pip install 'pagedgen[ray]' ({exc})") from exc
    try:
        autoscaling = parse_autoscaling(args.autoscaling_config)
        setup = ReplicaSetup(
            source=ModelSource(args.model, args.weights),
            engine=engine_config(args),
            options=options,
            num_replicas=args.replicas,
            replica_cpus=args.replica_cpus,
            autoscaling_config=autoscaling,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    return serve_replicas(setup, host=args.host, port=args.port, ray_address=args.ray_address)


def check_port_free(host: str, port: int) -> None:
    """Raise :class:`UsageError` unless ``host:port`` can be bound now (uvicorn binds it the same way)."""
    if port == 0:  # any free port: nothing to check
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a TIME_WAIT port is free
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc


def startup_lines(
    model: Model, config: EngineConfig, options: ServerOptions, snapshot: EngineSnapshot
) -> list[str]:
    """What an operator needs once the engine is up: the id clients send, the context, the cache, memory."""
    from pagedgen.engine.cache_layout import plan_cache_layout

    layout = plan_cache_layout(model, config)  # the engine's own plan (a pure function of model and config)
    kv_bytes = snapshot.total_blocks * layout.bytes_per_block + layout.window_bytes + layout.fixed_bytes
    return [
        f'model id to send: "{options.model_name}" (GET /v1/models lists it)',
        f"context length: {int(model.max_context)} tokens per request",
        f"KV cache: {snapshot.total_blocks} blocks of {config.block_size} tokens, {_mib(kv_bytes)}",
        f"weights: {model.weights_format.value} ({model.weights_reason}), dtype {_dtype_name(model.dtype)}",
        f"resident memory: {_mib(resident_bytes())}",
    ]


def resident_bytes() -> int:
    """This process's resident set size now (Linux /proc), else its peak (getrusage)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):.1f} MiB"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _announce_on_startup(app: FastAPI, lines: Callable[[], list[str]]) -> None:
    """Log ``lines()`` once the app's lifespan has started the engine (its cache size is known only then)."""
    import logging

    logger = logging.getLogger("pagedgen.cli")
    lifespan = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def announcing(app_: FastAPI) -> AsyncIterator[object]:
        async with lifespan(app_) as state:
            for line in lines():
                logger.info(line)
            yield state

    app.router.lifespan_context = announcing


def _log_to_stderr(level: str) -> None:
    """The server's own log lines (request failures, the shutdown), formatted as uvicorn's."""
    import logging

    from uvicorn.logging import DefaultFormatter

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s"))
    logger = logging.getLogger("pagedgen")
    logger.addHandler(handler)
    logger.setLevel(level.upper())


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedgen.llm import LLM

    llm = LLM(
        _load_model(args.model, args.weights),
        engine_config(args),
        speculative=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
        parse_special_in_content=args.parse_special_in_content,
    )
    params = sampling_params(args)
    started = time.perf_counter()
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params, use_tqdm=False)
    else:
        outputs = llm.generate(list(args.prompts), params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    for prompt, out in zip(args.prompts, outputs, strict=True):
        if args.json:
            record = {
                "prompt": prompt,
                "text": out.text,
                "token_ids": out.token_ids,
                "finish_reason": out.finish_reason,
                "prompt_tokens": len(out.prompt_token_ids),
            }
            if args.speculative:
                record.update(drafts_proposed=out.drafts_proposed, drafts_accepted=out.drafts_accepted)
            print(json.dumps(record, ensure_ascii=False))
        else:
            print(out.text)
    print(throughput_line(outputs, elapsed), file=sys.stderr, flush=True)
    return 0


def throughput_line(outputs: Sequence[CompletionOutput], elapsed: float) -> str:
    """The run's summary: prompts, tokens in and out, and generated tokens per second of wall time."""
    prompt_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    generated = sum(len(out.token_ids) for out in outputs)
    rate = generated / elapsed if elapsed > 0 else float("inf")
    plural = "" if len(outputs) == 1 else "s"
    return (
        f"[{len(outputs)} prompt{plural}: {prompt_tokens} prompt tokens, {generated} generated tokens "
        f"in {elapsed:.2f} s, {rate:.1f} tokens/s]"
    )


CHAT_HELP = (
    "Type a message and press Enter (Up/Down recall earlier lines). /help lists the commands; Ctrl-D quits."
)
CHAT_COMMANDS = (
    "/help          this list\n"
    "/reset         start a new conversation (same system message)\n"
    "/system TEXT   set the system message and start a new conversation (/system alone clears it)\n"
    "/quit, /exit   leave (as Ctrl-D)\n"
    "//TEXT         send TEXT starting with one '/'"
)


class ChatLoop:
    """The slash commands and the turn counter of ``pagedgen chat``, over one :class:`ChatSession` at a time.

    A line that starts with ``/`` is a command, handled here and never sent to the model; an unknown one is
    refused with a message, so a typo cannot become a turn. ``//`` escapes a message that starts with ``/``.
    """

    def __init__(self, new_session: Callable[[str | None], ChatSession], system: str | None):
        self._new_session = new_session
        self.system = system
        self.session = new_session(system)
        self.turn = 0

    def restart(self) -> None:
        self.session.close()
        self.session = self._new_session(self.system)
        self.turn = 0

    def command(self, line: str) -> tuple[bool, str | None]:
        """Handle a command line: (keep going, the message to print)."""
        name, _, rest = line.partition(" ")
        if name in ("/quit", "/exit"):
            return False, None
        if name == "/help":
            return True, CHAT_COMMANDS
        if name == "/reset":
            self.restart()
            return True, "[new conversation]"
        if name == "/system":
            self.system = rest.strip() or None
            self.restart()
            shown = "cleared" if self.system is None else repr(self.system)
            return True, f"[system message {shown}; new conversation]"
        return True, f"[unknown command {name}: not sent to the model; /help lists the commands]"


def split_chat_line(line: str) -> tuple[bool, str]:
    """(is a command, its text): ``/name args`` is a command; ``//text`` is the message ``/text``."""
    stripped = line.strip()
    if stripped.startswith("//"):
        return False, line.lstrip()[1:]
    if stripped.startswith("/"):
        return True, stripped
    return False, line


def _enable_line_editing() -> None:
    """Give input() history and editing (Up recalls, Left/Right move) where Python has readline."""
    with contextlib.suppress(ImportError):  # Windows without pyreadline: plain input()
        import readline  # noqa: F401  (importing it is what makes input() use it)


def cmd_chat(args: argparse.Namespace) -> int:
    from pagedgen.llm import LLM, ChatSession

    llm = LLM(
        _load_model(args.model, args.weights),
        engine_config(args),
        speculative=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
        parse_special_in_content=args.parse_special_in_content,
    )
    params = sampling_params(args)
    loop = ChatLoop(lambda system: ChatSession(llm, params, system), args.system)
    if sys.stdin.isatty():
        _enable_line_editing()
    print(CHAT_HELP, flush=True)
    try:
        while True:
            try:
                line = input(">>> ")
            except EOFError:
                print()
                return 0
            is_command, text = split_chat_line(line)
            if is_command:
                keep_going, message = loop.command(text)
                if message is not None:
                    print(message, flush=True)
                if not keep_going:
                    return 0
            elif text.strip():
                loop.turn += 1
                _chat_turn(loop.session, text, loop.turn, args.stats)
    finally:
        loop.session.close()


def _chat_turn(session: ChatSession, line: str, turn: int, stats: bool) -> None:
    try:
        for delta in session.send(line):
            print(delta, end="", flush=True)
    except KeyboardInterrupt:
        print("\n[interrupted]", flush=True)
        return
    except ValueError as exc:
        print(f"\n[error] {exc}", flush=True)
        return
    print(flush=True)
    last = session.last
    if stats and last is not None:
        cached = f" [cached_tokens={last.cached_tokens}]" if last.cached_tokens else ""
        print(
            f"[turn {turn}: prompt_tokens={last.prompt_tokens} generated_tokens={last.generated_tokens} "
            f"finish_reason={last.finish_reason}]{cached}",
            flush=True,
        )


def cmd_bench(argv: Sequence[str]) -> int:
    try:
        bench = importlib.import_module("pagedgen.bench.cli")
    except ModuleNotFoundError as exc:
        if exc.name not in ("pagedgen.bench.cli", "pagedgen.bench"):
            raise
        print("pagedgen bench is unavailable: pagedgen.bench.cli is not installed", file=sys.stderr)
        return 2
    result = bench.main(list(argv))
    return int(result or 0)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return cmd_bench(argv[1:])
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # exits with status 2, showing the subcommand's usage
        parser.subcommands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    handlers = {"serve": cmd_serve, "generate": cmd_generate, "chat": cmd_chat}
    return run_reporting_errors(handlers[args.command], args)


def run_reporting_errors(handler: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a subcommand; a user's mistake is one line on stderr and exit status 2 (``--debug``: raise)."""
    from pagedgen.errors import PagedGenError

    try:
        return handler(args)
    except (PagedGenError, UsageError) as exc:
        if args.debug:
            raise
        print(f"pagedgen {args.command}: error: {exc}", file=sys.stderr, flush=True)
        return USAGE_ERROR
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(file=sys.stderr)
        return 130  # the shell's status for a command ended by SIGINT


if __name__ == "__main__":
    sys.exit(main())
