"""Response payloads in the OpenAI wire format, for both routes, streaming and not.

One builder per HTTP request keeps what the chunks of one stream share (id, creation time, model name) and,
for the completions API, the running text offset of its logprobs. Payloads are plain dicts: they go straight
to ``json.dumps`` on the hot streaming path.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from pagedgen.llm import TokenLogprob
from pagedgen.server.protocol import new_id
from pagedgen.server.worker import Finish


def usage_dict(finish: Finish) -> dict[str, Any]:
    return {
        "prompt_tokens": finish.prompt_tokens,
        "completion_tokens": finish.generated_tokens,
        "total_tokens": finish.prompt_tokens + finish.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": finish.cached_prompt_tokens},
    }


class _Builder:
    id_prefix = ""

    def __init__(self, model_name: str, tokenizer: Any, logprobs: int | None, include_usage: bool):
        self.id = new_id(self.id_prefix)
        self.created = int(time.time())
        self.model = model_name
        self._tokenizer = tokenizer
        self.top_n = logprobs
        self.include_usage = include_usage

    def _token_text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def _envelope(self, obj: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }


class ChatResponses(_Builder):
    """``chat.completion`` and ``chat.completion.chunk`` payloads."""

    id_prefix = "chatcmpl"

    def first_chunk(self) -> dict[str, Any]:
        return self._chunk({"role": "assistant", "content": ""}, None, None)

    def chunk(self, text: str, logprobs: Sequence[TokenLogprob], finish_reason: str | None) -> dict[str, Any]:
        delta = {"content": text} if text else {}
        return self._chunk(delta, self.logprobs(logprobs) if logprobs else None, finish_reason)

    def _chunk(self, delta: dict[str, Any], logprobs: Any, finish_reason: str | None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        extra = {"usage": None} if self.include_usage else {}
        return self._envelope("chat.completion.chunk", [choice], **extra)

    def usage_chunk(self, finish: Finish) -> dict[str, Any]:
        return self._envelope("chat.completion.chunk", [], usage=usage_dict(finish))

    def full(
        self, text: str, logprobs: Sequence[TokenLogprob], finish_reason: str, finish: Finish
    ) -> dict[str, Any]:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": self.logprobs(logprobs) if self.top_n is not None else None,
            "finish_reason": finish_reason,
        }
        return self._envelope("chat.completion", [choice], usage=usage_dict(finish))

    def logprobs(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        content = []
        for entry in entries:
            top = [self._alternative(t, lp) for t, lp in entry.top[: self.top_n or 0]]
            content.append({**self._alternative(entry.token_id, entry.logprob), "top_logprobs": top})
        return {"content": content}

    def _alternative(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


class CompletionResponses(_Builder):
    """``text_completion`` payloads (the streaming chunks have the same object type)."""

    id_prefix = "cmpl"

    def __init__(self, model_name: str, tokenizer: Any, logprobs: int | None, include_usage: bool):
        super().__init__(model_name, tokenizer, logprobs, include_usage)
        self._offset = 0  # text offset of the next logprob entry

    def first_chunk(self) -> None:
        return None

    def chunk(self, text: str, logprobs: Sequence[TokenLogprob], finish_reason: str | None) -> dict[str, Any]:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": self.logprobs(logprobs) if logprobs else None,
            "finish_reason": finish_reason,
        }
        extra = {"usage": None} if self.include_usage else {}
        return self._envelope("text_completion", [choice], **extra)

    def usage_chunk(self, finish: Finish) -> dict[str, Any]:
        return self._envelope("text_completion", [], usage=usage_dict(finish))

    def full(
        self, text: str, logprobs: Sequence[TokenLogprob], finish_reason: str, finish: Finish
    ) -> dict[str, Any]:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": self.logprobs(logprobs) if self.top_n is not None else None,
            "finish_reason": finish_reason,
        }
        return self._envelope("text_completion", [choice], usage=usage_dict(finish))

    def logprobs(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for entry in entries:
            text = self._token_text(entry.token_id)
            tokens.append(text)
            token_logprobs.append(entry.logprob)
            top_logprobs.append({self._token_text(t): lp for t, lp in entry.top[: self.top_n or 0]})
            offsets.append(self._offset)
            self._offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }
