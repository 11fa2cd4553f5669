"""``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``: the Responses API over the chat route.

A request is translated (:mod:`.convert`) and served by the chat route's own path with a
:class:`~.output.ResponseBuilder` as its payload builder; a stored turn keeps its engine Request open
(the worker's :class:`~pagedgen.server.worker.Keep`) so a ``previous_response_id`` follow-up computes only
its new tokens. docs/server.md, "The Responses API", has the rules.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import ValidationError

from pagedgen.llm import prompt_chars
from pagedgen.server.guard import ApiError
from pagedgen.server.protocol import ChatCompletionRequest, error_param, new_id
from pagedgen.server.responses_api.convert import chat_turn, wire_message, wire_param
from pagedgen.server.responses_api.output import ResponseBuilder
from pagedgen.server.responses_api.store import ResponseStore, StoredResponse
from pagedgen.server.responses_api.wire import ResponsesRequest
from pagedgen.server.routes_misc import check_model
from pagedgen.server.serving import chat_builder, chat_ids, check_text, plan_auto_tools, serve
from pagedgen.server.worker import Keep

if TYPE_CHECKING:
    from pagedgen.core.json_value import JsonObject
    from pagedgen.server.app import _Server


def add_responses_routes(app: FastAPI, server: _Server) -> None:
    """Add the routes; ``server`` is the chat app's shared state."""
    store = ResponseStore(server.options.response_store, server.client.worker.release)
    app.state.response_store = store

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Any:
        return await _create(server, store, body, request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Any:
        return _stored(store, response_id).payload

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Any:
        if not store.delete(response_id):
            raise _not_found(response_id, None)
        return {"id": response_id, "object": "response.deleted", "deleted": True}


async def _create(
    server: _Server, store: ResponseStore, body: ResponsesRequest, request: Request
) -> Response | JsonObject:
    arrived = time.monotonic()
    check_model(body.model, server.options.model_name)
    if not hasattr(server.tokenizer, "apply_chat_template"):
        raise ApiError(400, f"model {body.model!r} has no chat template", param="input")
    previous = None
    if body.previous_response_id is not None:
        previous = _stored(store, body.previous_response_id, param="previous_response_id")
    turn = chat_turn(body, previous.conversation if previous is not None else [])
    chat_body = _chat_request(turn.body)
    messages = [m.as_template_message() for m in chat_body.messages]
    check_text(server, prompt_chars(messages), chat_body.requested_max_tokens, "input")
    auto = plan_auto_tools(server, chat_body)  # "auto" tools, as the chat route serves them
    messages = messages if auto is None else auto.prompt_messages(messages)
    response_id = new_id("resp", "_")
    keep = Keep(
        keep_as=response_id if body.store else None,
        resume=previous.id if previous is not None and previous.kept else None,
    )

    def done(response: JsonObject, message: JsonObject) -> None:
        if body.store:
            record = StoredResponse(response_id, response, [*turn.conversation, message], kept=True)
            store.put(record)

    header = _header(body, response_id, server.options.model_name)
    builder = ResponseBuilder(chat_builder(server, chat_body, auto), header, done)
    parse = server.options.parse_special_in_content
    template = functools.partial(
        chat_ids,
        server.tokenizer,
        messages,
        chat_body.template_tools,
        parse,
        **chat_body.template_options(),
    )

    def prepare() -> list[int]:
        ids = template()
        builder.input_tokens = len(ids)
        return ids

    try:
        return await serve(server, chat_body, prepare, builder, arrived, "input", request, keep)
    except ApiError as exc:
        raise ApiError(
            exc.status,
            wire_message(exc.message, exc.param),
            param=wire_param(exc.param),
            code=exc.code,
            headers=exc.headers,
        ) from exc
    finally:
        if body.store and not body.stream and store.get(response_id) is None:
            server.client.worker.release(response_id)  # it failed, or its client left: nothing follows it


def _chat_request(body: JsonObject) -> ChatCompletionRequest:
    """The chat route's request; a rule of its own that the translated body breaks is a 400 naming the
    Responses field."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        param = error_param(error, body)
        message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
        name = wire_param(param)
        if error.get("type") != "field_error":
            message = f"{name or 'input'}: {message}"
        raise ApiError(400, wire_message(message, param), param=name) from exc


def _header(body: ResponsesRequest, response_id: str, model: str) -> JsonObject:
    """The response object's fields that do not change while it is generated."""
    text_format = body.text_format.model_dump(by_alias=True) if body.text_format else {"type": "text"}
    tool_choice = body.tool_choice
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "instructions": body.instructions,
        "previous_response_id": body.previous_response_id,
        "max_output_tokens": body.max_output_tokens,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "parallel_tool_calls": True if body.parallel_tool_calls is None else body.parallel_tool_calls,
        "tool_choice": tool_choice.model_dump()
        if hasattr(tool_choice, "model_dump")
        else (tool_choice or "auto"),
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
        "text": {"format": text_format},
        "metadata": body.metadata or {},
        "store": body.store,
        "user": body.user,
        "background": False,
        "truncation": "disabled",
        "error": None,
    }


def _stored(store: ResponseStore, response_id: str, param: str | None = None) -> StoredResponse:
    record = store.get(response_id)
    if record is None:
        raise _not_found(response_id, param)
    return record


def _not_found(response_id: str, param: str | None) -> ApiError:
    what = "Previous response" if param == "previous_response_id" else "Response"
    message = f"{what} with id {response_id!r} not found (never stored, evicted, or deleted)."
    return ApiError(404, message, param=param, code="response_not_found")
