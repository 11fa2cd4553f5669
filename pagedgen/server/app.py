"""The OpenAI-compatible HTTP server: routes, error mapping and the streaming loop.

Handlers run on the asyncio event loop and never call the engine: they tokenize, validate, submit a copied job
to the :class:`EngineWorker` (the engine's owner thread) and consume the job's updates from an asyncio queue.
A client that disconnects before its response ends has its job cancelled (turn cancelled, request closed,
blocks freed): by the stream generator's cleanup, or for a non-streaming request by a disconnect watch.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive

from pagedgen.engine.events import EngineErrorCode
from pagedgen.llm import (
    check_prompt_fits,
    context_length,
    encode_prompt,
    finish_reason_text,
    is_engine_failure,
    tokenizer_for,
)
from pagedgen.models.tokenizer import IncrementalDetokenizer
from pagedgen.sampling.errors import SamplingOptionsError
from pagedgen.server.guard import DEFAULT_MAX_BODY_BYTES, ApiError, GuardMiddleware, error_body, error_json
from pagedgen.server.metrics import ServerMetrics
from pagedgen.server.protocol import ChatCompletionRequest, CompletionRequest
from pagedgen.server.responses import ChatResponses, CompletionResponses
from pagedgen.server.sse import DONE, EventStreamResponse, sse_event
from pagedgen.server.worker import AsyncEngineClient, EngineWorker, JobError, JobHandle, JobUpdate

_CLIENT_GONE = object()
_JOB_STATUS = {JobError.INVALID: 400, JobError.UNAVAILABLE: 503, JobError.INTERNAL: 500}


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """What ``pagedgen serve`` configures beyond the engine: the served name, the API key, the body limit."""

    model_name: str = "default"
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("ServerOptions.model_name must be non-empty")
        if self.max_body_bytes <= 0:
            raise ValueError(f"ServerOptions.max_body_bytes must be positive, got {self.max_body_bytes}")


@dataclass(slots=True)
class _Server:
    """What the routes share (one per app)."""

    client: AsyncEngineClient
    tokenizer: Any
    metrics: ServerMetrics
    options: ServerOptions
    context: int
    vocab_size: int


def build_app(model: Any, engine_config: Any, options: ServerOptions, *, tokenizer: Any = None) -> FastAPI:
    """A ready-to-serve app: the worker thread (and the engine on it) starts with the app's lifespan."""
    metrics = ServerMetrics(options.model_name)
    worker = EngineWorker(model, engine_config, metrics=metrics)
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

    app = FastAPI(title="pagedgen", lifespan=lifespan)
    app.state.worker = worker
    app.state.metrics = metrics
    server = _Server(AsyncEngineClient(worker), tokenizer, metrics, options, context, vocab_size)
    app.add_middleware(
        GuardMiddleware,
        healthy=lambda: worker.healthy,
        api_key=options.api_key,
        max_body_bytes=options.max_body_bytes,
    )
    _add_error_handlers(app)
    _add_routes(app, server)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return error_json(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        parts = []
        for error in errors:
            loc = ".".join(str(p) for p in error.get("loc", ()) if p != "body") or "body"
            message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
            if error.get("type") == "json_invalid":
                message = f"malformed JSON: {error.get('ctx', {}).get('error', message)}"
            parts.append(f"{loc}: {message}")
        first = errors[0].get("loc", ()) if errors else ()
        param = next((str(p) for p in first if p != "body"), None)
        return error_json(400, "; ".join(parts) or "invalid request body", param, "invalid_request")

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        return error_json(500, f"internal error: {type(exc).__name__}: {exc}")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_json(exc.status_code, str(exc.detail))


def _add_routes(app: FastAPI, server: _Server) -> None:
    name = server.options.model_name

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        server.metrics.set_engine(await server.client.sync())
        return Response(server.metrics.render(), media_type=server.metrics.content_type)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "pagedgen",
            "max_model_len": server.context,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        arrived = time.monotonic()
        _check_model(body.model, name)
        if not hasattr(server.tokenizer, "apply_chat_template"):
            raise ApiError(400, f"model {name!r} has no chat template: use /v1/completions", param="messages")
        messages = [m.as_template_message() for m in body.messages]
        try:
            ids = server.tokenizer.encode(
                server.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            )
        except ValueError as exc:
            raise ApiError(400, f"cannot apply the chat template: {exc}", param="messages") from exc
        builder = ChatResponses(name, server.tokenizer, body.requested_logprobs, body.include_usage)
        return await _serve(server, body, ids, builder, arrived, "messages", request.receive)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        arrived = time.monotonic()
        _check_model(body.model, name)
        prompt = body.prompt  # a string or token ids (a one-string list was unwrapped by validation)
        if isinstance(prompt, str):
            ids = encode_prompt(server.tokenizer, prompt)
        else:
            ids = list(prompt)
            if max(ids) >= server.vocab_size:
                message = f"prompt token id {max(ids)} is outside the vocabulary (size {server.vocab_size})"
                raise ApiError(400, message, param="prompt")
        builder = CompletionResponses(name, server.tokenizer, body.requested_logprobs, body.include_usage)
        return await _serve(server, body, ids, builder, arrived, "prompt", request.receive)


def _check_model(requested: str, served: str) -> None:
    if requested != served:
        raise ApiError(404, f"The model `{requested}` does not exist.", param="model", code="model_not_found")


async def _serve(
    server: _Server,
    body: Any,
    ids: list[int],
    builder: Any,
    arrived: float,
    prompt_param: str,
    receive: Receive,
) -> Any:
    """Validate the prompt length, submit the job, then stream or collect its output."""
    if not ids:
        raise ApiError(400, "the prompt is empty: at least one input token is required", param=prompt_param)
    max_tokens = body.requested_max_tokens
    try:  # the engine's one rule set, and the rule that needs the model (token ids in its vocabulary)
        params = body.to_sampling_params(max_tokens)
        params.check_vocabulary(server.vocab_size)
    except SamplingOptionsError as exc:
        raise ApiError(400, str(exc), param=body.wire_name(exc.field)) from exc
    problem = check_prompt_fits(len(ids), max_tokens, server.context)
    if problem is not None:
        raise ApiError(400, problem, param=prompt_param, code="context_length_exceeded")
    handle = server.client.submit(ids, params, arrived)
    try:
        first = await handle.next()
        if first.error is not None:
            raise ApiError(_JOB_STATUS[first.error], first.message, code=first.error.value)
    except BaseException:
        handle.cancel()
        raise
    text = IncrementalDetokenizer(server.tokenizer)
    if body.stream:
        return EventStreamResponse(_stream(handle, text, builder, server.metrics))
    try:
        result = await _unless_disconnected(_collect(handle, text, builder), receive)
        if result is _CLIENT_GONE:
            handle.cancel()
            server.metrics.on_disconnect()
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
        return result
    finally:
        handle.cancel()  # no-op unless the client left or the handler was interrupted


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


async def _collect(handle: JobHandle, text: IncrementalDetokenizer, builder: Any) -> dict[str, Any]:
    parts: list[str] = []
    logprobs = []
    while True:
        update = await handle.next()
        _raise_for(update)
        parts.append(text.add(update.tokens))
        logprobs.extend(update.logprobs)
        if update.finish is not None:
            parts.append(text.flush() + update.finish.text_before_stop)
            reason = finish_reason_text(update.finish.reason)
            return builder.full("".join(parts), logprobs, reason, update.finish)


def _raise_for(update: JobUpdate) -> None:
    if update.error is not None:
        raise ApiError(_JOB_STATUS[update.error], update.message, code=update.error.value)
    finish = update.finish
    if finish is not None and finish_reason_text(finish.reason) == "failed":
        if finish.error_code is EngineErrorCode.REQUEST_UNSERVICEABLE:
            raise ApiError(
                400, "the request can never fit the engine's KV cache", code="request_unserviceable"
            )
        if is_engine_failure(finish.error_code):
            raise ApiError(503, f"the engine failed ({finish.error_code.value})", code="unhealthy")
        raise ApiError(500, f"generation failed ({finish.error_code.value})")


async def _stream(
    handle: JobHandle, text: IncrementalDetokenizer, builder: Any, metrics: ServerMetrics
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
                yield sse_event(error_json_body(exc))
                break
            delta = text.add(update.tokens)
            finish = update.finish
            if finish is None:
                if delta or update.logprobs:
                    yield sse_event(builder.chunk(delta, update.logprobs, None))
                continue
            delta += text.flush() + finish.text_before_stop
            yield sse_event(builder.chunk(delta, update.logprobs, finish_reason_text(finish.reason)))
            if builder.include_usage:
                yield sse_event(builder.usage_chunk(finish))
            break
        yield DONE
    finally:
        left_early = not handle.done
        handle.cancel()  # queued before the disconnect is counted: a later /metrics sync sees it applied
        if left_early:
            metrics.on_disconnect()


def error_json_body(exc: ApiError) -> dict[str, Any]:
    return error_body(exc.status, exc.message, exc.param, exc.code)
