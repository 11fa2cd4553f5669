"""The OpenAI wire format: pydantic models for request bodies and response payloads.

Request models forbid unknown fields and are strict about types, so a typo'd or mistyped parameter is a 400
that names it instead of a silently ignored knob. This layer checks only the wire shape (types, ``n > 1``,
``top_logprobs`` without ``logprobs``); the value rules of every sampling parameter are the engine's one rule
set (:mod:`pagedgen.sampling.options`), applied when :meth:`to_sampling_params` builds the engine-facing
:class:`SamplingParams` (a :class:`SamplingOptionsError` there is a 400 naming :meth:`wire_name` of its
field). Checks that need the model (vocabulary, context length, model name) happen in the route.
Responses are built as plain dicts by :mod:`pagedgen.server.responses`.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pagedgen.llm import SamplingParams
from pagedgen.sampling.errors import SamplingOptionsError

PositiveInt = Annotated[int, Field(ge=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_message(self) -> dict[str, str]:
        """The ``{"role", "content"}`` dict a chat template expects (``developer`` -> ``system``)."""
        role = "system" if self.role == "developer" else self.role
        if self.content is None:
            content = ""
        elif isinstance(self.content, str):
            content = self.content
        else:
            content = "".join(part.text for part in self.content)
        return {"role": role, "content": content}


class _SamplingFields(_Strict):
    """The sampling parameters shared by both routes: OpenAI's, plus vLLM's extensions."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: PositiveInt = 1
    max_tokens: int | None = None
    temperature: Annotated[float, Field(le=2.0)] = 1.0  # OpenAI caps it at 2 (the engine does not)
    top_p: float = 1.0
    top_k: int = 0  # vLLM's -1 also disables top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"n={n} is not supported: pagedgen returns exactly one choice per request (n=1)")
        return n

    @model_validator(mode="after")
    def _check_stream_options(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def wire_name(self, field: str | None) -> str | None:
        """The body's name of a :class:`SamplingParams` field (they differ only where OpenAI's do)."""
        return field

    def _logit_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        bad = [key for key in self.logit_bias if not (key.isascii() and key.isdigit())]
        if bad:
            raise SamplingOptionsError(
                f"logit_bias keys must be token ids (decimal strings), got {bad[0][:40]!r}", "logit_bias"
            )
        return {int(k): v for k, v in self.logit_bias.items()}

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises :class:`SamplingOptionsError` naming the first bad field (the engine's one rule set)."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=0 if self.top_k == -1 else self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=self._stop_strings(),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self._logit_bias(),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
        )


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens disagree; send one of them")
        return self

    @property
    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        return self._sampling_params(max_tokens, self.requested_logprobs)

    def wire_name(self, field: str | None) -> str | None:
        if field == "logprobs":
            return "top_logprobs"
        if field == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return field


class CompletionRequest(_SamplingFields):
    prompt: (
        str
        | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
        | Annotated[list[str], Field(min_length=1)]
    )
    logprobs: int | None = None
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[int] | list[str]) -> str | list[int]:
        if isinstance(prompt, list) and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ValueError(
                    f"prompt holds {len(prompt)} strings: pagedgen serves one prompt per request"
                )
            return prompt[0]
        return prompt

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo=true is not supported")
        return echo

    @property
    def requested_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def requested_max_tokens(self) -> int | None:
        # The OpenAI completions API defaults to 16 tokens (chat has no such default).
        return 16 if self.max_tokens is None else self.max_tokens

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        return self._sampling_params(max_tokens, self.requested_logprobs)


def new_id(prefix: str) -> str:
    """A fresh OpenAI-style object id (``chatcmpl-…``, ``cmpl-…``)."""
    return f"{prefix}-{uuid.uuid4().hex}"
