"""The ``pagedgen`` command: ``serve`` (OpenAI-compatible server), ``generate``, ``chat`` and ``bench``.

Heavy imports (torch, the model code, FastAPI) happen inside the subcommands, so ``pagedgen --help`` is quick.
``pagedgen bench ...`` is handed whole to ``pagedgen.bench.cli:main(argv)`` when that module exists.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedgen", description="Continuous-batching LLM inference over a paged KV cache."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
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
    _add_engine_args(serve)
    _add_speculative_args(serve)
    _add_content_args(serve)

    generate = sub.add_parser("generate", help="complete prompts offline and print the completions")
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

    chat = sub.add_parser("chat", help="interactive chat: one multi-turn request, streamed replies")
    _add_model_args(chat)
    chat.add_argument("--system", help="system message")
    chat.add_argument("--stats", action="store_true", help="print token counts after every reply")
    _add_sampling_args(chat, default_max_tokens=512)
    _add_engine_args(chat)
    _add_speculative_args(chat)
    _add_content_args(chat)

    sub.add_parser("bench", help="benchmarks (see 'pagedgen bench --help')", add_help=False)
    return parser


def positive_int(text: str) -> int:
    """argparse type: a positive integer (also used by ``pagedgen bench``)."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


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


def _non_negative_seconds(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a non-negative number of seconds, got {text}")
    return value


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


def engine_config(args: argparse.Namespace) -> Any:
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
    )


def sampling_params(args: argparse.Namespace) -> Any:
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


def _load_model(name: str, weights: str = "native") -> Any:
    from pagedgen.models.model import Model

    print(f"loading model {name!r} ({weights} weights) ...", file=sys.stderr, flush=True)
    return Model(name, weights=weights)


# ---------------------------------------------------------------- subcommands


def server_options(args: argparse.Namespace) -> Any:
    from pagedgen.server.app import ServerOptions
    from pagedgen.server.guard import host_allow_list

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
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from pagedgen.server.app import build_app
    from pagedgen.server.lifecycle import build_server

    _log_to_stderr(args.log_level)
    options = server_options(args)
    app = build_app(_load_model(args.model, args.weights), engine_config(args), options)
    server = build_server(app, host=args.host, port=args.port, log_level=args.log_level)
    server.run()
    return 0 if server.started else 3  # 3: uvicorn's startup failure (it logged why)


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
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    else:
        outputs = llm.generate(list(args.prompts), params)
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
    return 0


CHAT_HELP = "Type a message and press Enter. /reset starts a new conversation; /exit or Ctrl-D quits."


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
    session = ChatSession(llm, params, args.system)
    print(CHAT_HELP, flush=True)
    turn = 0
    try:
        while True:
            try:
                line = input(">>> ")
            except EOFError:
                print()
                return 0
            command = line.strip()
            if command in ("/exit", "/quit"):
                return 0
            if command == "/reset":
                session.close()
                session = ChatSession(llm, params, args.system)
                print("[new conversation]", flush=True)
                continue
            if not command:
                continue
            turn += 1
            _chat_turn(session, line, turn, args.stats)
    finally:
        session.close()


def _chat_turn(session: Any, line: str, turn: int, stats: bool) -> None:
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
    args = build_parser().parse_args(argv)
    handlers = {"serve": cmd_serve, "generate": cmd_generate, "chat": cmd_chat}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
