"""One request's path through the server, shared by the chat, completions and Responses routes.

Admit (a ticket, or 429), build and check the request's :class:`SamplingParams` (a 400 naming the field),
tokenize off the event loop, submit one job to the engine's owner thread (``n > 1``:
:mod:`pagedgen.server.choices`), then stream or collect its updates into the route's payloads.
docs/server.md, "How it works", has the whole flow and why each step runs where it does.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import Response

from pagedgen.errors import InvalidArgumentError, SamplingOptionsError
from pagedgen.llm import (
    TextTokenizer,
    check_prompt_fits,
    check_text_fits,
    finish_reason_text,
    generator_params,
)
from pagedgen.models.tokenizer import IncrementalDetokenizer
from pagedgen.sampling.logprobs import TokenLogprob
from pagedgen.sampling.params import SamplingParams
from pagedgen.server.admission import RETRY_AFTER_S, Admission, Ticket
from pagedgen.server.auto_tools import AutoToolCalls, auto_tool_calls
from pagedgen.server.choices import run_choices
from pagedgen.server.guard import ApiError, request_id_of
from pagedgen.server.metrics import ServerMetrics
from pagedgen.server.prompting import chat_prompt_ids
from pagedgen.server.protocol import ChatCompletionRequest, RequestBody
from pagedgen.server.reasoning import PROMPT_TAIL_TOKENS, ReasoningResponses, reasoning_parser
from pagedgen.server.responses import ChatResponses, PayloadBuilder
from pagedgen.server.sse import DONE, EventStreamResponse, sse_event
from pagedgen.server.updates import (
    CLIENT_GONE,
    SHUTTING_DOWN,
    chunk,
    client_gone,
    error_json_body,
    raise_for,
    unless_disconnected,
)
from pagedgen.server.worker import SHUTDOWN_MESSAGE, JobHandle, Keep

if TYPE_CHECKING:
    from pagedgen.core.json_value import JsonObject, JsonValue
    from pagedgen.server.app import _Server

log = logging.getLogger("pagedgen.server")


def plan_auto_tools(server: _Server, body: ChatCompletionRequest) -> AutoToolCalls | None:
    """How a request's ``"auto"`` tools are prompted and parsed (None without them); a 400 if refused."""
    return auto_tool_calls(body, server.tokenizer, server.auto_tools)


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


def check_text(
    server: _Server, num_chars: int, max_tokens: int | None, param: str, tokens_param: str = "max_tokens"
) -> None:
    """Refuse, before any templating or tokenizing, a text too long to fit the context whatever it says
    (``tokens_param`` is named when the completion alone fills the context)."""
    bound = getattr(server.tokenizer, "max_token_chars", None)
    problem = check_text_fits(num_chars, max_tokens, server.context, bound)
    if problem is not None:
        alone = max_tokens is not None and max_tokens >= server.context
        raise ApiError(400, problem, param=tokens_param if alone else param, code="context_length_exceeded")


def chat_ids(
    tokenizer: TextTokenizer,
    messages: list[JsonObject],
    tools: list[JsonObject] | None,
    parse_special: bool,
    **template: JsonValue,
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
        raise ApiError(503, SHUTDOWN_MESSAGE, code="shutting_down", headers=SHUTTING_DOWN)
    if ticket is None:
        message = (
            f"the server is at capacity ({admission.capacity} requests admitted: {admission.max_running} "
            f"running, {admission.max_queued} queued); retry after {RETRY_AFTER_S} s"
        )
        raise ApiError(429, message, code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
    return ticket


async def serve(
    server: _Server,
    body: RequestBody,
    prepare: Callable[[], list[int]],
    builder: PayloadBuilder,
    arrived: float,
    prompt_param: str,
    request: Request,
    keep: Keep | None = None,
) -> Response | JsonObject:
    """Admit the request, check its parameters and tokenize it off the loop, then run its job; the ticket
    is released when the response ends (a stream's own cleanup releases it). ``keep``: the job's
    multi-turn options (the Responses API's, :mod:`pagedgen.server.responses_api`)."""
    if body.n > server.admission.max_running:  # its choices could never run together
        message = f"n={body.n} is more choices than the server runs at once (--max-batch-size "
        raise ApiError(400, message + f"{server.admission.max_running})", param="n")
    ticket = _admit(server.admission, body.n)
    response: Response | JsonObject | None = None
    try:
        params = await _sampling_params(server, body)
        ids = await asyncio.get_running_loop().run_in_executor(server.prepare_pool, prepare)
        split = builder.reasoning_split
        if split is not None:
            params = await _after_reasoning(server, body, split, params, ids)
        response = await _run_job(
            server, body, params, ids, builder, arrived, prompt_param, request, ticket, keep
        )
        return response
    finally:
        if not isinstance(response, EventStreamResponse):
            ticket.release()


async def _sampling_params(server: _Server, body: RequestBody) -> SamplingParams:
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
            await asyncio.to_thread(generator_params, server.model, params)
        params.check_vocabulary(server.vocab_size)
    except SamplingOptionsError as exc:
        raise ApiError(400, str(exc), param=body.wire_name(exc.field)) from exc
    except InvalidArgumentError as exc:  # the constraint does not compile for this model's tokenizer
        param = body.constraint_param if exc.field == "guidance" else body.wire_name(exc.field)
        raise ApiError(400, str(exc), param=param) from exc
    return params


async def _after_reasoning(
    server: _Server, body: RequestBody, builder: ReasoningResponses, params: SamplingParams, ids: list[int]
) -> SamplingParams:
    """Start the reply's reasoning split where the prompt leaves it, and move the output constraint (if
    any) after the reasoning; a combined grammar that does not compile is a 400 naming the constraint."""
    builder.begin(server.tokenizer.decode(ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False))
    if params.structured_outputs is None:
        return params
    try:
        constrained = await asyncio.to_thread(builder.constrain, params)
        if constrained is not params:
            await asyncio.to_thread(generator_params, server.model, constrained)
    except (SamplingOptionsError, InvalidArgumentError) as exc:
        raise ApiError(400, str(exc), param=body.constraint_param) from exc
    return constrained


async def _run_job(
    server: _Server,
    body: RequestBody,
    params: SamplingParams,
    ids: list[int],
    builder: PayloadBuilder,
    arrived: float,
    prompt_param: str,
    request: Request,
    ticket: Ticket,
    keep: Keep | None = None,
) -> Response | JsonObject:
    """Validate the prompt length, submit the job, then stream or collect its output."""
    if not ids:
        raise ApiError(400, "the prompt is empty: at least one input token is required", param=prompt_param)
    problem = check_prompt_fits(len(ids), params.max_tokens, server.context)
    if problem is not None:
        raise ApiError(400, problem, param=prompt_param, code="context_length_exceeded")
    if body.n > 1:
        return await run_choices(server, body, params, ids, builder, arrived, request, ticket)
    handle = server.client.submit(ids, params, arrived, request_id_of(request.scope) or "", keep)
    try:
        first = await unless_disconnected(handle.next(), request.receive)  # a queued client may leave
        if first is CLIENT_GONE:
            return client_gone(handle, server.metrics)
        raise_for(first)
    except BaseException:
        handle.cancel()
        raise
    text = IncrementalDetokenizer(server.tokenizer, body.skip_special_tokens)
    if body.stream:
        close = functools.partial(_close_stream, handle, ticket, server.metrics)
        stream = _stream(handle, text, builder, server.metrics, request_id_of(request.scope))
        return EventStreamResponse(stream, on_close=close)
    try:
        collected = await unless_disconnected(_collect(handle, text, builder), request.receive)
        if collected is CLIENT_GONE:
            return client_gone(handle, server.metrics)
        result, reason = collected
        server.metrics.on_success(reason)
        return result
    finally:
        handle.cancel()  # no-op unless the client left or the handler was interrupted


def _close_stream(handle: JobHandle, ticket: Ticket, metrics: ServerMetrics) -> None:
    """A stream response's last act, whether or not its generator ran: cancel an unfinished job, free the
    ticket. (A generator that ran has already cancelled and counted; ``handle.done`` is then set.)"""
    if not handle.done:
        handle.cancel()
        metrics.on_disconnect()
    ticket.release()


async def _collect(
    handle: JobHandle, text: IncrementalDetokenizer, builder: PayloadBuilder
) -> tuple[JsonObject, str]:
    """The whole response and the engine's finish reason (the response's may say "tool_calls")."""
    parts: list[str] = []
    logprobs: list[TokenLogprob] = []
    while True:
        update = await handle.next()
        raise_for(update)
        parts.append(await asyncio.to_thread(text.add, update.tokens))
        logprobs.extend(update.logprobs)
        if update.finish is not None:
            parts.append(await asyncio.to_thread(text.flush) + update.finish.text_before_stop)
            reason = finish_reason_text(update.finish.reason)
            full = await asyncio.to_thread(builder.full, "".join(parts), logprobs, reason, update.finish)
            return full, reason


async def _stream(
    handle: JobHandle,
    text: IncrementalDetokenizer,
    builder: PayloadBuilder,
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
                raise_for(update)
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
                    piece = await chunk(builder, delta, update.logprobs, None)
                    if piece is not None:  # None: the builder holds the text until the turn ends
                        yield sse_event(piece)
                continue
            delta += await asyncio.to_thread(text.flush) + finish.text_before_stop
            reason = finish_reason_text(finish.reason)
            last = await chunk(builder, delta, update.logprobs, reason)
            if last is not None:
                yield sse_event(last)
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
