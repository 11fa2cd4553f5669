"""The OpenAI-compatible HTTP server: routes, error mapping and the streaming loop.

Handlers run on the asyncio event loop and never call the engine: they take an admission ticket (429 once
``max_batch_size + max_queued_requests`` requests are in flight), tokenize and validate (chat templating
and tokenization run on the app's prepare threads, text decoding in asyncio's worker threads: they can take
milliseconds every other stream would wait for; a prompt whose characters alone cannot fit the context is
refused before either), submit a copied job to the :class:`EngineWorker` (the engine's owner thread) and
consume the job's updates from an asyncio queue. A client that disconnects before its response ends has its
job cancelled (turn cancelled, request closed, blocks freed): while its turn is queued and for a non-streaming
request, by a disconnect watch; while it streams, by the stream response's cleanup, which runs even if the
stream never started.

``/health`` and ``/metrics`` read the worker's health flag and published snapshot: they never wait for the
engine thread, and they answer when the engine is unhealthy (``/health`` then with 503).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive

from pagedgen.errors import EngineErrorCode, InvalidArgumentError, SamplingOptionsError
from pagedgen.llm import (
    SamplingParams,
    TokenLogprob,
    check_prompt_fits,
    check_text_fits,
    context_length,
    encode_prompt,
    finish_reason_text,
    is_engine_failure,
    prompt_chars,
    tokenizer_for,
)
from pagedgen.models.tokenizer import IncrementalDetokenizer
from pagedgen.server.admission import DEFAULT_MAX_QUEUED_REQUESTS, RETRY_AFTER_S, Admission, Ticket
from pagedgen.server.apidocs import add_offline_docs
from pagedgen.server.auto_tools import AutoToolCalls, AutoToolSettings, auto_tool_calls
from pagedgen.server.cors import add_cors, check_origin
from pagedgen.server.guard import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    ApiError,
    GuardMiddleware,
    error_body,
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
from pagedgen.server.prompting import chat_prompt_ids
from pagedgen.server.protocol import ChatCompletionRequest, CompletionRequest
from pagedgen.server.reasoning import PROMPT_TAIL_TOKENS, ReasoningResponses, reasoning_parser
from pagedgen.server.responses import ChatResponses, CompletionResponses
from pagedgen.server.responses_api.store import StoreLimits
from pagedgen.server.routes_misc import MiscContext, add_misc_routes, check_model, model_card
from pagedgen.server.sse import DONE, EventStreamResponse, sse_event
from pagedgen.server.worker import (
    SHUTDOWN_MESSAGE,
    UNAVAILABLE_MESSAGE,
    AsyncEngineClient,
    EngineWorker,
    JobError,
    JobHandle,
    JobUpdate,
    Keep,
)

log = logging.getLogger("pagedgen.server")

_CLIENT_GONE = object()
_JOB_STATUS = {
    JobError.INVALID: 400,
    JobError.UNAVAILABLE: 503,
    JobError.SHUTDOWN: 503,
    JobError.INTERNAL: 500,
}
_SHUTTING_DOWN = {"Retry-After": str(RETRY_AFTER_S), "Connection": "close"}  # a draining server's 503
_NAMED_ERRORS = ("lone_surrogate", "field_error")  # validation errors whose message and ctx name the field
_PYDANTIC_TAG = re.compile(r"[\[\](),-]|^(str|int|float|bool|dict|list|none)$|^[A-Z]")  # a union member's tag
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
    tokenizer: Any
    metrics: ServerMetrics
    options: ServerOptions
    context: int
    vocab_size: int
    admission: Admission
    model: Any  # for checks that need it off the engine thread (a constraint against its tokenizer)
    prepare_pool: ThreadPoolExecutor  # templating and tokenizing, apart from the streams' per-token work


def build_app(model: Any, engine_config: Any, options: ServerOptions, *, tokenizer: Any = None) -> FastAPI:
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
    worker: EngineWorker,
    tokenizer: Any,
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
    from pagedgen.server.responses_api.route import add_responses_routes  # it uses this module's helpers

    add_responses_routes(app, server)
    auto_tools = AutoToolSettings(options.enable_auto_tool_choice, options.tool_call_parser)
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
            param = _error_param(error, body)
            parts.append(message if error.get("type") in _NAMED_ERRORS else f"{param or 'body'}: {message}")
        param = _error_param(errors[0], body) if errors else None
        return error_json(400, "; ".join(parts) or "invalid request body", param, "invalid_request")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, _exc: Exception) -> JSONResponse:
        """A last resort: the guard answers (and logs) a route's exception; this sees only its own."""
        return error_json(500, internal_error_message(request_id_of(request.scope)), code="internal_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_json(exc.status_code, str(exc.detail))


def _error_param(error: Any, body: Any) -> str | None:
    """The body path of a validation error (``messages[0].content``).

    pydantic's ``loc`` also names union members (``str``, ``list[TextPart]``) and discriminator values
    (``json_schema``); walking the request body along it keeps only the segments that are its keys and
    indexes (and a last, missing field's name). A discriminator value can also be a key of the object
    (``response_format: {"type": "json_schema", "json_schema": ...}``): for an unknown key, the walk that
    skips the value and reaches the key wins (``response_format.strictly``)."""
    ctx = error.get("ctx") or {}
    if error.get("type") in _NAMED_ERRORS and isinstance(ctx.get("param"), str):
        return ctx["param"]
    loc = [part for part in error.get("loc", ()) if part != "body"]
    path, reached = _body_path(loc, body, skip_tags=False)
    if error.get("type") == "extra_forbidden" and not reached:
        tagless, reached = _body_path(loc, body, skip_tags=True)
        if reached:
            return tagless
    return path


def _body_path(loc: list[Any], body: Any, *, skip_tags: bool) -> tuple[str | None, bool]:
    """The body path along ``loc``, and whether its last segment is in the body."""
    path, node, present = "", body, False
    for index, part in enumerate(loc):
        if skip_tags and isinstance(node, dict) and node.get("type") == part and index < len(loc) - 1:
            continue  # the discriminator's value, not a key
        present = isinstance(node, dict) and part in node
        present = present or (isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node))
        if not present and (index < len(loc) - 1 or _PYDANTIC_TAG.search(str(part))):
            continue  # a union member's or a discriminator's tag
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
        node = node[part] if present else None
    return path or None, present


def _add_routes(app: FastAPI, server: _Server) -> None:
    name = server.options.model_name

    @app.get("/health")
    async def health() -> Any:
        if not server.client.worker.healthy:
            return error_json(503, UNAVAILABLE_MESSAGE, code="unhealthy")
        if server.admission.closed:  # draining: a load balancer should send its traffic elsewhere
            return error_json(503, SHUTDOWN_MESSAGE, code="shutting_down", headers=_SHUTTING_DOWN)
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
        _check_text(server, prompt_chars(messages), body.requested_max_tokens, "messages", tokens)
        auto = plan_auto_tools(server, body)
        messages = messages if auto is None else auto.prompt_messages(messages)
        builder = chat_builder(server, body, auto)
        parse = server.options.parse_special_in_content
        prepare = functools.partial(
            _chat_ids, server.tokenizer, messages, body.template_tools, parse, **body.template_options()
        )
        return await _serve(server, body, prepare, builder, arrived, "messages", request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        arrived = time.monotonic()
        _check_model(body.model, name)
        prompts = body.prompts
        if len(prompts) == 1:
            return await _complete(server, body, prompts[0], "prompt", arrived, request)
        return await _complete_batch(server, body, prompts, arrived, request)


_check_model = check_model  # the routes here and in routes_misc.py share one model check


def plan_auto_tools(server: _Server, body: ChatCompletionRequest) -> AutoToolCalls | None:
    """How a request's ``"auto"`` tools are prompted and parsed (None without them); a 400 if refused."""
    settings = AutoToolSettings(server.options.enable_auto_tool_choice, server.options.tool_call_parser)
    return auto_tool_calls(body, server.tokenizer, settings)


def chat_builder(
    server: _Server, body: ChatCompletionRequest, auto: AutoToolCalls | None = None
) -> ChatResponses | ReasoningResponses:
    """The chat payload builder of a request (the Responses API builds on the same one): ``auto`` parses
    automatic tool calls; with a reasoning parser, its split of reasoning and content wraps the builder."""
    builder = ChatResponses(
        server.options.model_name,
        server.tokenizer,
        body.requested_logprobs,
        body.include_usage,
        body.forced_tool_calls,
        auto,
    )
    if server.options.reasoning_parser is None:
        return builder
    parser = reasoning_parser(server.options.reasoning_parser)
    return ReasoningResponses(builder, parser, body.chat_template_kwargs or {})


async def _complete(
    server: _Server,
    body: CompletionRequest,
    prompt: str | list[int],
    param: str,
    arrived: float,
    request: Request,
) -> Any:
    """One prompt's completion (``param`` names it in errors: ``prompt``, or ``prompt[i]`` of a batch)."""
    if isinstance(prompt, str):
        _check_text(server, len(prompt), body.requested_max_tokens, param)
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
    return await _serve(server, body, prepare, builder, arrived, param, request)


async def _complete_batch(
    server: _Server, body: CompletionRequest, prompts: list[str | list[int]], arrived: float, request: Request
) -> Any:
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


def _check_text(
    server: _Server, num_chars: int, max_tokens: int | None, param: str, tokens_param: str = "max_tokens"
) -> None:
    """Refuse, before any templating or tokenizing, a text too long to fit the context whatever it says
    (``tokens_param`` is named when the completion alone fills the context)."""
    bound = getattr(server.tokenizer, "max_token_chars", None)
    problem = check_text_fits(num_chars, max_tokens, server.context, bound)
    if problem is not None:
        alone = max_tokens is not None and max_tokens >= server.context
        raise ApiError(400, problem, param=tokens_param if alone else param, code="context_length_exceeded")


def _chat_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    parse_special: bool,
    **template: Any,
) -> list[int]:
    """The prompt ids of a chat (runs in a worker thread: templating and tokenizing can be slow); the
    messages' text is encoded as text unless ``parse_special``.

    ``tools`` go to the template as transformers passes them (a template that does not mention them
    ignores them); ``template`` holds the request's template options
    (:func:`pagedgen.server.prompting.chat_prompt_ids`)."""
    return chat_prompt_ids(tokenizer, messages, tools, parse_special, **template)


def _admit(admission: Admission, count: int = 1) -> Ticket:
    ticket = admission.admit(count)
    if ticket is None and admission.closed:
        raise ApiError(503, SHUTDOWN_MESSAGE, code="shutting_down", headers=_SHUTTING_DOWN)
    if ticket is None:
        message = (
            f"the server is at capacity ({admission.capacity} requests admitted: {admission.max_running} "
            f"running, {admission.max_queued} queued); retry after {RETRY_AFTER_S} s"
        )
        raise ApiError(429, message, code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
    return ticket


async def _serve(
    server: _Server,
    body: Any,
    prepare: Callable[[], list[int]],
    builder: Any,
    arrived: float,
    prompt_param: str,
    request: Request,
    keep: Keep | None = None,
) -> Any:
    """Admit the request, check its parameters and tokenize it off the loop, then run its job; the ticket
    is released when the response ends (a stream's own cleanup releases it). ``keep``: the job's
    multi-turn options (the Responses API's, :mod:`pagedgen.server.responses_api`)."""
    if body.n > server.admission.max_running:  # its choices could never run together
        message = f"n={body.n} is more choices than the server runs at once (--max-batch-size "
        raise ApiError(400, message + f"{server.admission.max_running})", param="n")
    ticket = _admit(server.admission, body.n)
    response: Any = None
    try:
        params = await _sampling_params(server, body)
        ids = await asyncio.get_running_loop().run_in_executor(server.prepare_pool, prepare)
        split = _reasoning_split(builder)
        if split is not None:
            params = await _after_reasoning(server, body, split, params, ids)
        response = await _run_job(
            server, body, params, ids, builder, arrived, prompt_param, request, ticket, keep
        )
        return response
    finally:
        if not isinstance(response, EventStreamResponse):
            ticket.release()


async def _sampling_params(server: _Server, body: Any) -> SamplingParams:
    """The request's engine parameters, or a 400 naming the bad field.

    An output constraint is compiled here, and against the model's tokenizer, in a worker thread (a large
    schema can take many milliseconds): a refusal is a 400 before the engine sees the request, and the
    compiled grammar is cached for the engine thread, which then does not stall the batch compiling it.
    """
    build = functools.partial(body.to_sampling_params, body.requested_max_tokens)
    try:  # the engine's one rule set, and the rule that needs the model (token ids in its vocabulary)
        if not body.constrains_output:
            params = build()
        else:
            params = await asyncio.to_thread(build)
            await asyncio.to_thread(params.generator_params, server.model)
        params.check_vocabulary(server.vocab_size)
    except SamplingOptionsError as exc:
        raise ApiError(400, str(exc), param=body.wire_name(exc.field)) from exc
    except InvalidArgumentError as exc:  # the constraint does not compile for this model's tokenizer
        param = body.constraint_param if exc.field == "guidance" else body.wire_name(exc.field)
        raise ApiError(400, str(exc), param=param) from exc
    return params


def _reasoning_split(builder: Any) -> ReasoningResponses | None:
    """The reasoning split of a chat builder, also when another route's builder wraps it (``.chat``)."""
    for candidate in (builder, getattr(builder, "chat", None)):
        if isinstance(candidate, ReasoningResponses):
            return candidate
    return None


async def _after_reasoning(
    server: _Server, body: Any, builder: ReasoningResponses, params: SamplingParams, ids: list[int]
) -> SamplingParams:
    """Start the reply's reasoning split where the prompt leaves it, and move the output constraint (if
    any) after the reasoning; a combined grammar that does not compile is a 400 naming the constraint."""
    builder.begin(server.tokenizer.decode(ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False))
    if params.structured_outputs is None:
        return params
    try:
        constrained = await asyncio.to_thread(builder.constrain, params)
        if constrained is not params:
            await asyncio.to_thread(constrained.generator_params, server.model)
    except (SamplingOptionsError, InvalidArgumentError) as exc:
        raise ApiError(400, str(exc), param=body.constraint_param) from exc
    return constrained


async def _run_job(
    server: _Server,
    body: Any,
    params: SamplingParams,
    ids: list[int],
    builder: Any,
    arrived: float,
    prompt_param: str,
    request: Request,
    ticket: Ticket,
    keep: Keep | None = None,
) -> Any:
    """Validate the prompt length, submit the job, then stream or collect its output."""
    if not ids:
        raise ApiError(400, "the prompt is empty: at least one input token is required", param=prompt_param)
    problem = check_prompt_fits(len(ids), params.max_tokens, server.context)
    if problem is not None:
        raise ApiError(400, problem, param=prompt_param, code="context_length_exceeded")
    if body.n > 1:
        from pagedgen.server.choices import run_choices  # it uses this module's helpers

        return await run_choices(server, body, params, ids, builder, arrived, request, ticket)
    handle = server.client.submit(ids, params, arrived, request_id_of(request.scope) or "", keep)
    try:
        first = await _unless_disconnected(handle.next(), request.receive)  # a queued client may leave
        if first is _CLIENT_GONE:
            return _client_gone(handle, server.metrics)
        _raise_for(first)
    except BaseException:
        handle.cancel()
        raise
    text = IncrementalDetokenizer(server.tokenizer, body.skip_special_tokens)
    if body.stream:
        close = functools.partial(_close_stream, handle, ticket, server.metrics)
        stream = _stream(handle, text, builder, server.metrics, request_id_of(request.scope))
        return EventStreamResponse(stream, on_close=close)
    try:
        collected = await _unless_disconnected(_collect(handle, text, builder), request.receive)
        if collected is _CLIENT_GONE:
            return _client_gone(handle, server.metrics)
        result, reason = collected
        server.metrics.on_success(reason)
        return result
    finally:
        handle.cancel()  # no-op unless the client left or the handler was interrupted


def _client_gone(handle: JobHandle, metrics: ServerMetrics) -> Response:
    handle.cancel()
    metrics.on_disconnect()
    return Response(status_code=499)  # nginx's "client closed request": nobody reads it


def _close_stream(handle: JobHandle, ticket: Ticket, metrics: ServerMetrics) -> None:
    """A stream response's last act, whether or not its generator ran: cancel an unfinished job, free the
    ticket. (A generator that ran has already cancelled and counted; ``handle.done`` is then set.)"""
    if not handle.done:
        handle.cancel()
        metrics.on_disconnect()
    ticket.release()


async def _unless_disconnected(work: Coroutine[Any, Any, Any], receive: Receive) -> Any:
    """The result of ``work``, or ``_CLIENT_GONE`` if the client disconnects first.

    Starlette only notices disconnects of streaming responses; without this watch, a client that gives up
    on a long non-streaming completion would keep its turn generating (and its blocks held) to the end.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        done, _pending = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        return task.result() if task in done else _CLIENT_GONE
    finally:
        task.cancel()
        watcher.cancel()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _collect(
    handle: JobHandle, text: IncrementalDetokenizer, builder: Any
) -> tuple[dict[str, Any], str]:
    """The whole response and the engine's finish reason (the response's may say "tool_calls")."""
    parts: list[str] = []
    logprobs = []
    while True:
        update = await handle.next()
        _raise_for(update)
        parts.append(await asyncio.to_thread(text.add, update.tokens))
        logprobs.extend(update.logprobs)
        if update.finish is not None:
            parts.append(await asyncio.to_thread(text.flush) + update.finish.text_before_stop)
            reason = finish_reason_text(update.finish.reason)
            full = await asyncio.to_thread(builder.full, "".join(parts), logprobs, reason, update.finish)
            return full, reason


def _raise_for(update: JobUpdate) -> None:
    if update.error is not None:
        headers = _SHUTTING_DOWN if update.error is JobError.SHUTDOWN else None
        raise ApiError(_JOB_STATUS[update.error], update.message, code=update.error.value, headers=headers)
    finish = update.finish
    if finish is not None and finish_reason_text(finish.reason) == "failed":
        if finish.error_code is EngineErrorCode.REQUEST_UNSERVICEABLE:
            raise ApiError(
                400, "the request can never fit the engine's KV cache", code="request_unserviceable"
            )
        if is_engine_failure(finish.error_code):
            raise ApiError(503, f"the engine failed ({finish.error_code.value})", code="unhealthy")
        if finish.error_code is EngineErrorCode.GUIDANCE_FAILED:  # the request's constraint, not a bug
            message = f"the output constraint failed during generation: {finish.error_message}"
            raise ApiError(400, message, code="guidance_failed")
        raise ApiError(500, f"generation failed ({finish.error_code.value})")


async def _stream(
    handle: JobHandle,
    text: IncrementalDetokenizer,
    builder: Any,
    metrics: ServerMetrics,
    request_id: str | None,
) -> AsyncIterator[bytes]:
    """SSE chunks of one job; cancels the job if the stream ends early (client disconnect)."""
    try:
        first = builder.first_chunk()
        if first is not None:
            yield sse_event(first)
        while True:
            update = await handle.next()
            try:
                _raise_for(update)
            except ApiError as exc:
                metrics.on_error_status(exc.status)
                if exc.status >= 500:
                    log.error("request %s failed with %d: %s", request_id, exc.status, exc.message)
                yield sse_event(error_json_body(exc))
                break
            delta = await asyncio.to_thread(text.add, update.tokens)
            finish = update.finish
            if finish is None:
                if delta or update.logprobs:
                    chunk = await _chunk(builder, delta, update.logprobs, None)
                    if chunk is not None:  # None: the builder holds the text until the turn ends
                        yield sse_event(chunk)
                continue
            delta += await asyncio.to_thread(text.flush) + finish.text_before_stop
            reason = finish_reason_text(finish.reason)
            yield sse_event(await _chunk(builder, delta, update.logprobs, reason))
            metrics.on_success(reason)
            if builder.include_usage:
                yield sse_event(builder.usage_chunk(finish))
            break
        yield DONE
    finally:
        left_early = not handle.done
        handle.cancel()  # queued before the disconnect is counted: a later /metrics sync sees it applied
        if left_early:
            metrics.on_disconnect()


async def _chunk(builder: Any, text: str, logprobs: Sequence[TokenLogprob], reason: str | None) -> Any:
    """One stream chunk; built in a worker thread when it decodes logprob tokens (up to 21 per token)."""
    if not logprobs:
        return builder.chunk(text, logprobs, reason)
    return await asyncio.to_thread(builder.chunk, text, logprobs, reason)


def error_json_body(exc: ApiError) -> dict[str, Any]:
    return error_body(exc.status, exc.message, exc.param, exc.code)
