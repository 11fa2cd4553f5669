"""Server-sent events as the OpenAI API streams them: ``data: {json}`` events, then ``data: [DONE]``."""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Send

DONE = b"data: [DONE]\n\n"


def sse_event(payload: dict[str, Any]) -> bytes:
    """One SSE ``data`` event carrying ``payload`` as compact JSON."""
    return (
        b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"
    )


class EventStreamResponse(StreamingResponse):
    """A ``text/event-stream`` response that always closes its generator, however the stream ends.

    Starlette cancels the stream task when the client disconnects (the generator's ``finally`` runs then), but
    a failed ``send`` only abandons the iterator; closing it here makes the generator's cleanup (cancel the
    engine job) run promptly in both cases.
    """

    media_type = "text/event-stream"

    def __init__(self, content: Any, **kwargs: Any):
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **kwargs.pop("headers", {})}
        super().__init__(content, headers=headers, **kwargs)

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
