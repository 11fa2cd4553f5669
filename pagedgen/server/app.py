"""The OpenAI-compatible HTTP server: the app, its routes and its error mapping.

Handlers run on the event loop and never call the engine: a request's path (admission, parameters,
tokenizing off the loop, the job on the engine's owner thread, the stream) is :mod:`pagedgen.server.serving`;
``/health`` and ``/metrics`` read the worker's published snapshot, so they answer without waiting for the
engine, and while it is unhealthy. docs/server.md, "How it works", has the whole design.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedgen.llm import TextTokenizer, context_length, encode_prompt, prompt_chars, tokenizer_for
from pagedgen.server.admission import DEFAULT_MAX_QUEUED_REQUESTS, Admission
from pagedgen.server.apidocs import add_offline_docs
from pagedgen.server.auto_tools import AutoToolSettings
from pagedgen.server.cors import add_cors, check_origin
from pagedgen.server.guard import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    ApiError,
    GuardMiddleware,
    error_json,
    internal_error_message,
    request_id_of,
)
from pagedgen.server.lifecycle import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_KEEP_ALIVE_TIMEOUT_S,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
)
from pagedgen.server.metrics import ServerMetrics
from pagedgen.server.page import add_chat_page
from pagedgen.server.protocol import NAMED_ERRORS, ChatCompletionRequest, CompletionRequest, error_param
from pagedgen.server.reasoning import reasoning_parser
from pagedgen.server.responses import CompletionResponses
from pagedgen.server.responses_api.route import add_responses_routes
from pagedgen.server.responses_api.store import StoreLimits
from pagedgen.server.routes_misc import MiscContext, add_misc_routes, check_model, model_card
from pagedgen.server.serving import chat_builder, chat_ids, check_text, plan_auto_tools, serve
from pagedgen.server.updates import SHUTTING_DOWN
from pagedgen.server.worker import SHUTDOWN_MESSAGE, UNAVAILABLE_MESSAGE, AsyncEngineClient, EngineWorker
from pagedgen.server.worker_protocol import ServingWorker

if TYPE_CHECKING:
    from pagedgen.core.json_value import JsonObject
    from pagedgen.engine.config import EngineConfig
    from pagedgen.llm import ModelView, ServedModel

log = logging.getLogger("pagedgen.server")

# Prompt preparation (templating, tokenizing) runs on its own few threads: on asyncio's default pool, six
# long tokenizations held every thread and a running stream's per-token decoding queued behind them.
PREPARE_THREADS = max(1, min(4, (os.cpu_count() or 1) // 2))


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """What ``pagedgen serve`` configures beyond the engine.

    ``max_queued_requests``: how many requests may wait beyond a full batch (``max_batch_size`` running);
    past that, 429 with ``Retry-After`` (see :mod:`pagedgen.server.admission`). ``speculative="ngram"``:
    prompt-lookup drafts, up to ``num_speculative_tokens`` per step and request (:mod:`pagedgen.spec`).

    Connections and shutdown (:mod:`pagedgen.server.lifecycle`; seconds): a request head must arrive within
    ``header_timeout``, its body within ``body_timeout``, a kept-alive connection is closed after
    ``keep_alive_timeout`` idle; on SIGTERM/SIGINT the requests in flight get ``shutdown_timeout`` to finish.
    ``docs=False`` removes ``/docs``, ``/redoc`` and ``/openapi.json`` (with an ``api_key`` they need it).
    ``allowed_hosts``: None for no ``Host`` check, else the names accepted beyond localhost and loopback
    addresses (:func:`pagedgen.server.guard.host_allow_list` decides it for ``pagedgen serve``).
    ``parse_special_in_content``: read special-token strings in messages and prompts as special tokens
    (off: they are text, and only the chat template's markup writes control tokens).
    ``allowed_origins``: the web origins answered cross-origin (``*`` for all; empty: no CORS), see
    :mod:`pagedgen.server.cors`. ``reasoning_parser``: how chat replies split into reasoning and content
    (:mod:`pagedgen.server.reasoning`; None: they are all content).
    ``response_store``: how many stored Responses-API responses are kept, and for how long
    (:mod:`pagedgen.server.responses_api.store`).
    ``enable_auto_tool_choice`` serves ``tool_choice: "auto"`` (and tools without ``tool_choice``) in the
    ``tool_call_parser`` format, None: the chat template's (:mod:`pagedgen.server.auto_tools`).
    """

    model_name: str = "default"
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS
    speculative: str | None = None
    num_speculative_tokens: int = 4
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    keep_alive_timeout: float = DEFAULT_KEEP_ALIVE_TIMEOUT_S
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S
    docs: bool = True
    allowed_hosts: frozenset[str] | None = None
    parse_special_in_content: bool = False
    allowed_origins: tuple[str, ...] = ()
    reasoning_parser: str | None = None
    response_store: StoreLimits = StoreLimits()
    enable_auto_tool_choice: bool = True
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.reasoning_parser is not None:
            reasoning_parser(self.reasoning_parser)  # ValueError naming the known parsers
        AutoToolSettings(self.enable_auto_tool_choice, self.tool_call_parser)  # raises naming a bad parser
        for origin in self.allowed_origins:
            check_origin(origin)
        if not self.model_name:
            raise ValueError("ServerOptions.model_name must be non-empty")
        if self.max_body_bytes <= 0:
            raise ValueError(f"ServerOptions.max_body_bytes must be positive, got {self.max_body_bytes}")
        if self.max_queued_requests < 0:
            raise ValueError(
                f"ServerOptions.max_queued_requests must be >= 0, got {self.max_queued_requests}"
            )
        if self.speculative not in (None, "ngram"):  # pagedgen.spec.SPECULATIVE_METHODS
            raise ValueError(f"ServerOptions.speculative must be None or 'ngram', got {self.speculative!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"ServerOptions.num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}"
            )
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"ServerOptions.shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        for name in ("keep_alive_timeout", "header_timeout", "body_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ServerOptions.{name} must be positive, got {getattr(self, name)}")


@dataclass(slots=True)
class _Server:
    """What the routes share (one per app)."""

    client: AsyncEngineClient
    tokenizer: TextTokenizer
    metrics: ServerMetrics
    options: ServerOptions
    context: int
    vocab_size: int
    admission: Admission
    model: ModelView  # for checks that need it off the engine thread (a constraint against its tokenizer)
    prepare_pool: ThreadPoolExecutor  # templating and tokenizing, apart from the streams' per-token work
    auto_tools: AutoToolSettings  # how "auto" tool calls are served (built once from the options)


def build_app(
    model: ServedModel,
    engine_config: EngineConfig,
    options: ServerOptions,
    *,
    tokenizer: TextTokenizer | None = None,
) -> FastAPI:
    """A ready-to-serve app: the worker thread (and the engine on it) starts with the app's lifespan."""
    metrics = ServerMetrics(options.model_name)
    worker = EngineWorker(
        model,
        engine_config,
        metrics=metrics,
        speculative=options.speculative,
        num_speculative_tokens=options.num_speculative_tokens,
    )
    tok = tokenizer if tokenizer is not None else tokenizer_for(model)
    return create_app(
        worker, tok, metrics, options, context=context_length(model), vocab_size=model.vocab_size
    )


def create_app(
    worker: ServingWorker,
    tokenizer: TextTokenizer,
    metrics: ServerMetrics,
    options: ServerOptions,
    *,
    context: int,
    vocab_size: int,
) -> FastAPI:
    """The FastAPI app over an (unstarted) worker; the lifespan starts it and shuts it down."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(worker.start)
        try:
            yield
        finally:
            await asyncio.to_thread(worker.shutdown)
            server.prepare_pool.shutdown(wait=False, cancel_futures=True)

    # FastAPI's own /docs and /redoc load their assets from a CDN: add_offline_docs serves them locally.
    openapi_url = "/openapi.json" if options.docs else None
    app = FastAPI(title="pagedgen", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=openapi_url)
    if options.docs:
        add_offline_docs(app)
    add_chat_page(app)
    admission = Admission(worker.max_batch_size, options.max_queued_requests)
    metrics.bind(snapshot=lambda: worker.snapshot, admitted=lambda: admission.in_flight)
    app.state.options = options
    app.state.worker = worker
    app.state.metrics = metrics
    app.state.admission = admission
    prepare_pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="pagedgen-prepare")
    auto_tools = AutoToolSettings(options.enable_auto_tool_choice, options.tool_call_parser)
    server = _Server(
        AsyncEngineClient(worker),
        tokenizer,
        metrics,
        options,
        context,
        vocab_size,
        admission,
        worker.model,
        prepare_pool,
        auto_tools,
    )
    app.add_middleware(
        GuardMiddleware,
        healthy=lambda: worker.healthy,
        api_key=options.api_key,
        max_body_bytes=options.max_body_bytes,
        allowed_hosts=options.allowed_hosts,
        draining=lambda: admission.closed,
        body_timeout=options.body_timeout,
        on_rejected=metrics.on_rejected,
        on_failed=metrics.on_failed,
    )
    if options.allowed_origins:
        add_cors(app, options.allowed_origins)  # outside the guard: a preflight carries no key
    _add_error_handlers(app, metrics)
    _add_routes(app, server)
    add_responses_routes(app, server)
    misc = MiscContext(
        options.model_name,
        context,
        vocab_size,
        tokenizer,
        options.parse_special_in_content,
        prepare_pool,
        auto_tools,
    )
    add_misc_routes(app, misc)
    return app


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        metrics.on_error_status(exc.status)
        request_id = request_id_of(request.scope)
        if exc.status >= 500:
            log.error("request %s failed with %d: %s", request_id, exc.status, exc.message)
        message = internal_error_message(request_id) if exc.status == 500 else exc.message
        return error_json(exc.status, message, exc.param, exc.code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.on_rejected("invalid")
        errors, body = exc.errors(), exc.body
        parts = []
        for error in errors:
            message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
            if error.get("type") == "json_invalid":
                message = f"malformed JSON: {error.get('ctx', {}).get('error', message)}"
            param = error_param(error, body)
            parts.append(message if error.get("type") in NAMED_ERRORS else f"{param or 'body'}: {message}")
        param = error_param(errors[0], body) if errors else None
        return error_json(400, "; ".join(parts) or "invalid request body", param, "invalid_request")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, _exc: Exception) -> JSONResponse:
        """A last resort: the guard answers (and logs) a route's exception; this sees only its own."""
        return error_json(500, internal_error_message(request_id_of(request.scope)), code="internal_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_json(exc.status_code, str(exc.detail))


def _add_routes(app: FastAPI, server: _Server) -> None:
    name = server.options.model_name

    @app.get("/health")
    async def health() -> Any:
        if not server.client.worker.healthy:
            return error_json(503, UNAVAILABLE_MESSAGE, code="unhealthy")
        if server.admission.closed:  # draining: a load balancer should send its traffic elsewhere
            return error_json(503, SHUTDOWN_MESSAGE, code="shutting_down", headers=SHUTTING_DOWN)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=server.metrics.content_type)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(name, server.context)]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        arrived = time.monotonic()
        _check_model(body.model, name)
        if not hasattr(server.tokenizer, "apply_chat_template"):
            raise ApiError(400, f"model {name!r} has no chat template: use /v1/completions", param="messages")
        messages = [m.as_template_message() for m in body.messages]
        tokens = body.wire_name("max_tokens")
        check_text(server, prompt_chars(messages), body.requested_max_tokens, "messages", tokens)
        auto = plan_auto_tools(server, body)
        messages = messages if auto is None else auto.prompt_messages(messages)
        builder = chat_builder(server, body, auto)
        parse = server.options.parse_special_in_content
        prepare = functools.partial(
            chat_ids, server.tokenizer, messages, body.template_tools, parse, **body.template_options()
        )
        return await serve(server, body, prepare, builder, arrived, "messages", request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        arrived = time.monotonic()
        _check_model(body.model, name)
        prompts = body.prompts
        if len(prompts) == 1:
            return await _complete(server, body, prompts[0], "prompt", arrived, request)
        return await _complete_batch(server, body, prompts, arrived, request)


_check_model = check_model  # the routes here and in routes_misc.py share one model check


async def _complete(
    server: _Server,
    body: CompletionRequest,
    prompt: str | list[int],
    param: str,
    arrived: float,
    request: Request,
) -> Response | JsonObject:
    """One prompt's completion (``param`` names it in errors: ``prompt``, or ``prompt[i]`` of a batch)."""
    if isinstance(prompt, str):
        check_text(server, len(prompt), body.requested_max_tokens, param)
        parse = server.options.parse_special_in_content
        prepare = functools.partial(encode_prompt, server.tokenizer, prompt, parse_special=parse)
        echo = prompt if body.echo else ""
    else:
        ids = list(prompt)
        if max(ids) >= server.vocab_size:
            message = f"prompt token id {max(ids)} is outside the vocabulary (size {server.vocab_size})"
            raise ApiError(400, message, param=param)
        prepare = functools.partial(list, ids)
        decode = functools.partial(server.tokenizer.decode, ids, skip_special_tokens=body.skip_special_tokens)
        echo = await asyncio.to_thread(decode) if body.echo else ""
    name = server.options.model_name
    builder = CompletionResponses(name, server.tokenizer, body.requested_logprobs, body.include_usage, echo)
    return await serve(server, body, prepare, builder, arrived, param, request)


async def _complete_batch(
    server: _Server, body: CompletionRequest, prompts: list[str | list[int]], arrived: float, request: Request
) -> Response | JsonObject:
    """A batch of prompts: each its own job (and admission ticket), run together; ``n`` choices per prompt
    in order (prompt 0's first), usage summed. A refused prompt refuses the batch (the others are
    cancelled)."""
    if body.stream:
        message = "a batch of prompts is answered without streaming: send stream=false, or one prompt"
        raise ApiError(400, message, param="stream")
    if len(prompts) * body.n > server.admission.capacity:
        choices = f" of n={body.n} choices ({len(prompts) * body.n} requests)" if body.n > 1 else ""
        message = (
            f"prompt holds {len(prompts)} prompts{choices}; this server admits at most "
            f"{server.admission.capacity}"
        )
        raise ApiError(400, message, param="prompt")
    tasks = [
        asyncio.ensure_future(_complete(server, body, prompt, f"prompt[{index}]", arrived, request))
        for index, prompt in enumerate(prompts)
    ]
    try:
        results = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    gone = next((result for result in results if isinstance(result, Response)), None)
    if gone is not None:
        return gone  # the client left
    choices = []
    for result in results:
        for choice in result["choices"]:
            choices.append({**choice, "index": len(choices)})
    usage = {
        key: sum(result["usage"][key] for result in results)
        for key in results[0]["usage"]
        if key != "prompt_tokens_details"
    }
    cached = sum(result["usage"]["prompt_tokens_details"]["cached_tokens"] for result in results)
    usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return {**results[0], "choices": choices, "usage": usage}
