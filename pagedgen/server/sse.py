"""Server-sent events as the OpenAI API streams them: ``data: {json}`` events, then ``data: [DONE]``
(the Responses API's events also carry their ``event:`` name)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

if TYPE_CHECKING:
    from pagedgen.core.json_value import JsonObject

DONE = b"data: [DONE]\n\n"


def sse_event(payload: JsonObject | list[JsonObject]) -> bytes:
    """One SSE ``data`` event carrying ``payload`` as compact JSON; a list is one event per payload, each
    named by its ``type`` (``event: response.created``), as the Responses API streams them."""
    if isinstance(payload, list):
        return b"".join(
            b"event: " + event["type"].encode("utf-8") + b"\n" + sse_event(event) for event in payload
        )
    return (
        b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"
    )


class EventStreamResponse(StreamingResponse):
    """A ``text/event-stream`` response whose cleanup runs however the stream ends, or never starts.

    Starlette cancels the stream task when the client disconnects (the generator's ``finally`` runs then), but
    a failed ``send`` only abandons the iterator; closing it here makes the generator's cleanup run promptly.
    Neither helps a generator that never started: if the client is already gone when the response is called,
    the stream task is cancelled while it sends the response start, and closing an unstarted generator runs
    none of its code. ``on_close`` (cancel the engine job, release the admission ticket) therefore runs from
    ``__call__`` itself, in every case.
    """

    media_type = "text/event-stream"

    def __init__(self, content: Any, *, on_close: Callable[[], None] = lambda: None, **kwargs: Any):
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **kwargs.pop("headers", {})}
        super().__init__(content, headers=headers, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
