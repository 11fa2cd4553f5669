"""The small routes clients probe besides generation: ``/tokenize``, ``/detokenize``, ``/version`` and one
model's card, ``/v1/models/{id}`` (vLLM's shapes).

``/tokenize`` encodes a ``prompt`` exactly as ``/v1/completions`` does (the tokenizer's sequence tokens
first, unless ``add_special_tokens`` is false) or ``messages`` exactly as ``/v1/chat/completions`` does (the
same template options), so its ``count`` is the request's ``usage.prompt_tokens``. Tokenizing runs on the
prepare threads, apart from the streams. All of them are behind the API key (the guard's keyed paths).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI

import pagedgen
from pagedgen.server.auto_tools import AutoToolSettings, tokenized_messages
from pagedgen.server.guard import ApiError
from pagedgen.server.prompting import chat_prompt_ids
from pagedgen.server.protocol import DetokenizeRequest, TokenizeRequest

if TYPE_CHECKING:
    from pagedgen.core.json_value import JsonObject
    from pagedgen.llm import TextTokenizer

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class MiscContext:
    """What these routes read of the server."""

    model_name: str
    context: int
    vocab_size: int
    tokenizer: TextTokenizer
    parse_special: bool
    prepare_pool: ThreadPoolExecutor
    auto_tools: AutoToolSettings = AutoToolSettings()  # the chat route's, for a chat sent with tools


def model_card(name: str, context: int) -> JsonObject:
    return {"id": name, "object": "model", "created": 0, "owned_by": "pagedgen", "max_model_len": context}


def check_model(requested: str, served: str) -> None:
    if requested != served:
        raise ApiError(404, f"The model `{requested}` does not exist.", param="model", code="model_not_found")


def add_misc_routes(app: FastAPI, ctx: MiscContext) -> None:
    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        check_model(model_id, ctx.model_name)
        return model_card(ctx.model_name, ctx.context)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": pagedgen.__version__}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        if body.model is not None:
            check_model(body.model, ctx.model_name)
        ids = await _off_loop(ctx, functools.partial(_tokenize, ctx, body))
        answer: JsonObject = {"count": len(ids), "max_model_len": ctx.context, "tokens": ids}
        if body.return_token_strs:
            answer["token_strs"] = await _off_loop(ctx, functools.partial(_token_strs, ctx.tokenizer, ids))
        return answer

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        if body.model is not None:
            check_model(body.model, ctx.model_name)
        bad = [token for token in body.tokens if token >= ctx.vocab_size]
        if bad:
            message = f"token id {bad[0]} is outside the vocabulary (size {ctx.vocab_size})"
            raise ApiError(400, message, param="tokens")
        decode = functools.partial(
            ctx.tokenizer.decode, body.tokens, skip_special_tokens=body.skip_special_tokens
        )
        return {"prompt": await _off_loop(ctx, decode)}


async def _off_loop(ctx: MiscContext, work: Callable[[], T]) -> T:
    return await asyncio.get_running_loop().run_in_executor(ctx.prepare_pool, work)


def _tokenize(ctx: MiscContext, body: TokenizeRequest) -> list[int]:
    if body.messages is None:
        add_special = body.add_special_tokens is not False
        return _encode_text(ctx.tokenizer, body.prompt or "", add_special, ctx.parse_special)
    if not hasattr(ctx.tokenizer, "apply_chat_template"):
        raise ApiError(400, f"model {ctx.model_name!r} has no chat template: send a prompt", param="messages")
    messages = [message.as_template_message() for message in body.messages]
    tools = None if body.tools is None else [tool.model_dump(exclude_none=True) for tool in body.tools]
    messages = tokenized_messages(messages, tools, ctx.tokenizer, ctx.auto_tools)
    return chat_prompt_ids(ctx.tokenizer, messages, tools, ctx.parse_special, **body.template_options())


def _encode_text(tokenizer: TextTokenizer, text: str, add_special: bool, parse_special: bool) -> list[int]:
    """As :func:`pagedgen.llm.encode_prompt`, with the sequence tokens optional."""
    parameters = inspect.signature(tokenizer.encode).parameters
    kwargs: dict[str, bool] = {"parse_special": parse_special} if "parse_special" in parameters else {}
    if "add_special_tokens" in parameters:
        kwargs["add_special_tokens"] = add_special
    return tokenizer.encode(text, **kwargs)


def _token_strs(tokenizer: TextTokenizer, ids: list[int]) -> list[str]:
    return [tokenizer.decode([token], skip_special_tokens=False) for token in ids]
