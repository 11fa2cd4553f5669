"""Offline helpers on top of the engine loop: ``pg.LLM(model).generate(prompts, pg.SamplingParams(...))``.

Like vLLM's ``LLM`` this is the batch API (every prompt one Request, all submitted at once, continuous
batching runs them), with ``LLM.chat`` and :class:`ChatSession` (a conversation kept as one multi-turn
Request, so a later turn prefills only its new tokens) beside it; the Engine belongs to the thread that
builds the ``LLM``. docs/server.md, "Offline batches: pg.LLM", has the contract.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from pagedgen.errors import EngineError
from pagedgen.models.tokenizer import ChatPrompt
from pagedgen.sampling.logprobs import TokenLogprob as TokenLogprob
from pagedgen.sampling.options import is_int
from pagedgen.sampling.params import SamplingParams as SamplingParams
from pagedgen.sampling.params import StructuredOutputsParams as StructuredOutputsParams
from pagedgen.sampling.params import choice_grammar as choice_grammar

if TYPE_CHECKING:
    from collections.abc import Iterable

    from tqdm import tqdm

    from pagedgen.core.json_value import JsonValue
    from pagedgen.engine.config import EngineConfig
    from pagedgen.engine.events import EngineErrorCode, EngineEvent, FinishReason, TokenLogprobs
    from pagedgen.engine.request import GeneratorParams, Request, RequestOptions, TurnOptions
    from pagedgen.models.model import Model
    from pagedgen.models.synthetic import SyntheticModel

    # The models an engine serves: a loaded checkpoint, or the synthetic oracle (same surface).
    ServedModel = Model | SyntheticModel

_MAX_EVENTS = 256


class TextTokenizer(Protocol):
    """The tokenizer surface the helpers and the server use: ``pg.Tokenizer``, or a model's own (the
    synthetic model's). Chat rendering (``render_chat`` / ``apply_chat_template`` / ``encode_chat``) and
    ``max_token_chars`` are optional: the helpers probe for them."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], /, skip_special_tokens: bool = True) -> str: ...


class ModelView(Protocol):
    """What the serving code reads of a model apart from the engine: the parameter checks
    (:func:`generator_params`, :func:`context_length`, a structured-outputs constraint compiled against the
    tokenizer) and the app's vocabulary and context limits. ``pg.Model`` and ``pg.SyntheticModel`` have these
    four, and so does the replicated ingress's ``ModelCard``, which holds no weights; the server is typed
    against this view, so it takes any of the three."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_context(self) -> int: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def tokenizer(self) -> TextTokenizer: ...


def generator_params(model: ModelView, params: SamplingParams) -> GeneratorParams:
    """A fresh ``pg.GeneratorParams`` carrying ``params`` (raises if the model refuses one of them).

    The structured-outputs constraint is set here too, although each turn sets its own
    (:func:`turn_options`): ``GeneratorParams`` checks it against the model's tokenizer, so ``LLM.generate``
    and the server refuse a constraint the vocabulary cannot follow before submitting anything.
    """
    from pagedgen.engine.request import GeneratorParams

    return GeneratorParams(model, params)


def turn_options(request: Request, params: SamplingParams) -> TurnOptions:
    """A ``pg.TurnOptions`` for one turn of ``request``: token limit, stop strings, logprobs, and the
    structured-outputs constraint (a turn option, so a chat session can constrain one turn only)."""
    from pagedgen.engine.request import TurnOptions

    options = TurnOptions(request)
    if params.structured_outputs is not None:
        options.set_guidance(*params.structured_outputs.guidance())
    if params.max_tokens is not None:
        options.set_max_generated_tokens(params.max_tokens)
    if params.stop:
        options.set_stop_strings(list(params.stop))
    if params.logprobs is not None:
        # The engine reads 0 as "no logprobs"; OpenAI's top_logprobs=0 still wants the sampled token's.
        options.set_logprobs(max(params.logprobs, 1))
    return options


@dataclass(slots=True)
class CompletionOutput:
    """The result for one prompt. ``finish_reason`` is OpenAI's: "stop" (EOS or a stop string) or "length";
    "failed" when the engine could not serve the prompt. ``stop_reason`` is the matched stop string, if any:
    ``text`` then ends exactly where it begins, while ``token_ids`` (and ``logprobs``) end before the token in
    which it begins (see ``EngineEvent.text_before_stop``).
    """

    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: str | None = None
    cached_prompt_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    drafts_proposed: int = 0  # draft tokens the engine verified for this prompt (speculative decoding)
    drafts_accepted: int = 0  # of those, accepted


def turn_text(tokenizer: TextTokenizer, tokens: list[int], finish: EngineEvent) -> str:
    """A finished turn's text: its emitted tokens, then the text before the stop string that no emitted
    token carries (``finish`` is the TURN_FINISHED event). Exactly the generated text cut at the stop string.
    """
    return tokenizer.decode(tokens) + finish.text_before_stop


def finish_reason_text(reason: FinishReason) -> str:
    """The OpenAI ``finish_reason`` of an engine ``FinishReason``: end of text -> stop, a limit -> length."""
    from pagedgen.engine.events import FinishReason

    if reason in (FinishReason.EOS, FinishReason.STOP_SEQUENCE):
        return "stop"
    if reason in (FinishReason.MAX_GENERATED_TOKENS, FinishReason.MAX_SESSION_TOKENS):
        return "length"
    return "cancelled" if reason is FinishReason.CANCELLED else "failed"


def is_engine_failure(error_code: EngineErrorCode) -> bool:
    """True for the error codes that mean the engine itself failed (it is unhealthy from then on)."""
    from pagedgen.errors import EngineErrorCode

    return error_code in (EngineErrorCode.ENGINE_CONTRACT_FAILURE, EngineErrorCode.ENGINE_EXECUTION_FAILURE)


def copy_logprobs(token: int, logprobs: TokenLogprobs, top_n: int) -> TokenLogprob:
    """A :class:`TokenLogprob` copied off an event's logprobs, keeping the top ``top_n`` alternatives."""
    return TokenLogprob(token, float(logprobs.logprob), tuple(logprobs.top[:top_n]))


def context_length(model: ModelView) -> int:
    """The most tokens (prompt + generated) one request of ``model`` may hold."""
    return int(model.max_context)


def check_prompt_fits(num_prompt_tokens: int, max_tokens: int | None, context: int) -> str | None:
    """None when the prompt plus ``max_tokens`` fits the context; else the OpenAI-style reason."""
    if num_prompt_tokens == 0:
        return "the prompt is empty: at least one input token is required"
    wanted = num_prompt_tokens + (max_tokens if max_tokens is not None else 1)
    if wanted <= context:
        return None
    return (
        f"This model's maximum context length is {context} tokens. However, you requested {wanted} tokens "
        f"({num_prompt_tokens} in the prompt, {wanted - num_prompt_tokens} in the completion). "
        "Please reduce the length of the prompt or completion."
    )


def check_text_fits(
    num_chars: int, max_tokens: int | None, context: int, max_token_chars: int | None
) -> str | None:
    """None unless a text of ``num_chars`` characters surely cannot fit the context; else the reason.

    No token stands for more than ``max_token_chars`` characters (``Tokenizer.max_token_chars``), so the
    text needs at least ``num_chars / max_token_chars`` tokens: a text past that bound is refused before
    anything templates or tokenizes it (the cost of either grows with the text). ``None`` for the bound
    (a tokenizer without one) refuses only a completion that alone fills the context.
    """
    wanted = max_tokens if max_tokens is not None else 1
    if wanted >= context:
        return (
            f"This model's maximum context length is {context} tokens. However, you requested {wanted} "
            "tokens for the completion alone, which leaves no room for the prompt. "
            "Please reduce the length of the completion."
        )
    room = context - wanted
    if max_token_chars is None or num_chars <= room * max_token_chars:
        return None
    at_least = -(-num_chars // max_token_chars)
    return (
        f"This model's maximum context length is {context} tokens. However, the prompt holds {num_chars} "
        f"characters, which is at least {at_least} tokens (no token of this model spans more than "
        f"{max_token_chars} characters), and {context - room} more are requested for the completion. "
        "Please reduce the length of the prompt or completion."
    )


def encode_prompt(tokenizer: TextTokenizer, text: str, *, parse_special: bool = False) -> list[int]:
    """Token ids of a raw-text prompt, with the special tokens (BOS) the tokenizer puts at a sequence start.

    Special-token strings written in the prompt are text unless ``parse_special`` (the caller's text is
    never control, see :mod:`pagedgen.models.tokenizer`). Chat prompts are encoded without BOS instead:
    the chat template writes its own.
    """
    parameters = inspect.signature(tokenizer.encode).parameters
    kwargs: dict[str, bool] = {"parse_special": parse_special} if "parse_special" in parameters else {}
    if "add_special_tokens" in parameters:
        kwargs["add_special_tokens"] = True
    return tokenizer.encode(text, **kwargs)


def render_chat_prompt(
    tokenizer: TextTokenizer,
    messages: Sequence[Mapping[str, JsonValue]],
    *,
    parse_special_in_content: bool = False,
    **template_vars: JsonValue,
) -> ChatPrompt:
    """The rendered prompt of a conversation (ending with the generation prompt) and its template's markup.

    A tokenizer without ``render_chat`` (one that has no special tokens to guard, e.g. the synthetic
    model's) is rendered with its ``apply_chat_template`` and encoded as a whole.
    """
    if hasattr(tokenizer, "render_chat"):
        return tokenizer.render_chat(
            messages, True, parse_special_in_content=parse_special_in_content, **template_vars
        )
    return ChatPrompt(
        tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, **template_vars)
    )


def encode_chat_prompt(tokenizer: TextTokenizer, prompt: ChatPrompt, start: int = 0) -> list[int]:
    """Ids of ``prompt.text[start:]``: markup as special tokens, the client's text as text."""
    if hasattr(tokenizer, "encode_chat"):
        return tokenizer.encode_chat(prompt, start)
    return tokenizer.encode(prompt.text[start:])


def prompt_chars(messages: Sequence[Mapping[str, JsonValue]]) -> int:
    """Characters of the messages' text contents (what :func:`check_text_fits` bounds; the template only
    adds to them)."""
    total = 0
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        total += len(content) if isinstance(content, str) else 0
    return total


def tokenizer_for(model: ServedModel) -> TextTokenizer:
    """The tokenizer of ``model``: ``pg.Tokenizer(model)`` for a real model, the model's own otherwise."""
    from pagedgen.models.model import Model

    if isinstance(model, Model):
        from pagedgen.models.tokenizer import Tokenizer

        return Tokenizer(model)
    return model.tokenizer


@dataclass(slots=True)
class _Slot:
    """The in-flight state of one prompt of a ``generate`` call."""

    index: int
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    generator_params: GeneratorParams  # validated against the model before anything was submitted
    request: Request | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)


class LLM:
    """Offline batch generation over one engine (owner: the constructing thread).

    ``model`` is a ``pg.Model``, a model name or path for ``pg.Model``, or any object with the same surface
    (e.g. ``SyntheticModel``). ``engine_config`` defaults to ``pg.EngineConfig()``. ``speculative="ngram"``
    proposes up to ``num_speculative_tokens`` prompt-lookup drafts per step (``ValueError`` for another
    method or a count above ``engine.max_draft_tokens_per_proposal()``).

    Special-token strings in text prompts and chat messages are encoded as text (the chat template's own
    markup still yields its special tokens); ``parse_special_in_content=True`` reads them as special tokens
    again (the text is then trusted to write control tokens, e.g. a caller that renders prompts itself).
    """

    def __init__(
        self,
        model: ServedModel | str,
        engine_config: EngineConfig | None = None,
        *,
        tokenizer: TextTokenizer | None = None,
        speculative: str | None = None,
        num_speculative_tokens: int = 4,
        parse_special_in_content: bool = False,
    ):
        from pagedgen.engine.config import EngineConfig
        from pagedgen.engine.engine import Engine
        from pagedgen.spec import make_driver

        if isinstance(model, str):
            from pagedgen.models.model import Model

            model = Model(model)
        self.model = model
        self.tokenizer = tokenizer if tokenizer is not None else tokenizer_for(model)
        self.parse_special_in_content = parse_special_in_content
        self.engine = Engine(model, engine_config if engine_config is not None else EngineConfig())
        try:
            self.drafter = make_driver(self.engine, speculative, num_speculative_tokens)
        except ValueError:
            self.engine.close()
            raise
        self._buffer = self.engine.create_event_buffer(_MAX_EVENTS)

    def _propose(self, requests: Iterable[Request]) -> None:
        """Set the drafter's proposals before a step (no-op without speculative decoding)."""
        if self.drafter is not None:
            self.drafter.propose(requests)

    @property
    def context_length(self) -> int:
        return context_length(self.model)

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[CompletionOutput]:
        """Complete every prompt (text or token ids); results in prompt order.

        Raises ``ValueError`` before anything is submitted when a prompt does not fit the context, and
        re-raises an engine failure after closing every request of this call.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        elif prompts and is_int(prompts[0]):
            prompts = [list(prompts)]
        params = self._per_prompt(sampling_params, len(prompts))
        for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
            if isinstance(prompt, str):
                self._check_text(i, len(prompt), sp)
        texts, ids = self._normalize(prompts)
        return self._run(texts, ids, params, use_tqdm)

    def chat(
        self,
        conversations: Sequence[Mapping[str, str]] | Sequence[Sequence[Mapping[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[CompletionOutput]:
        """Generate the assistant reply of each conversation (a list of ``{"role", "content"}`` messages)."""
        if conversations and isinstance(conversations[0], Mapping):
            conversations = [conversations]  # type: ignore[list-item]
        params = self._per_prompt(sampling_params, len(conversations))
        for i, (conversation, sp) in enumerate(zip(conversations, params, strict=True)):
            self._check_text(i, prompt_chars(conversation), sp)  # type: ignore[arg-type]
        prompts = [self.chat_prompt(list(c)) for c in conversations]  # type: ignore[arg-type]
        texts: list[str | None] = [prompt.text for prompt in prompts]
        ids = [encode_chat_prompt(self.tokenizer, prompt) for prompt in prompts]
        return self._run(texts, ids, params, use_tqdm)

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The prompt text of a conversation, ending with the assistant generation prompt."""
        return self.chat_prompt(messages).text

    def chat_prompt(self, messages: Sequence[Mapping[str, str]]) -> ChatPrompt:
        """The rendered conversation with its template's markup (what :func:`encode_chat_prompt` encodes)."""
        return render_chat_prompt(
            self.tokenizer, list(messages), parse_special_in_content=self.parse_special_in_content
        )

    def start_chat(self, sampling_params: SamplingParams | None = None) -> ChatSession:
        """An interactive conversation kept as one multi-turn engine Request (see :class:`ChatSession`)."""
        return ChatSession(self, sampling_params or SamplingParams(max_tokens=None))

    # ------------------------------------------------------------ internals

    def _check_text(self, index: int, num_chars: int, params: SamplingParams) -> None:
        """Refuse a text that cannot fit the context before rendering or tokenizing it."""
        bound = getattr(self.tokenizer, "max_token_chars", None)
        problem = check_text_fits(num_chars, params.max_tokens, self.context_length, bound)
        if problem is not None:
            raise ValueError(f"prompt {index}: {problem}")

    def _normalize(self, prompts: Sequence[str | Sequence[int]]) -> tuple[list[str | None], list[list[int]]]:
        texts: list[str | None] = []
        ids: list[list[int]] = []
        for p in prompts:
            if isinstance(p, str):
                texts.append(p)
                ids.append(encode_prompt(self.tokenizer, p, parse_special=self.parse_special_in_content))
            else:
                texts.append(None)
                ids.append([int(t) for t in p])
        return texts, ids

    @staticmethod
    def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
        return params

    def _run(
        self, texts: list[str | None], ids: list[list[int]], params: list[SamplingParams], use_tqdm: bool
    ) -> list[CompletionOutput]:
        slots = []  # every prompt is checked (fit, options against the model) before any is submitted
        for i, (text, prompt_ids, sp) in enumerate(zip(texts, ids, params, strict=True)):
            problem = check_prompt_fits(len(prompt_ids), sp.max_tokens, self.context_length)
            if problem is not None:
                raise ValueError(f"prompt {i}: {problem}")
            slots.append(_Slot(i, text, prompt_ids, sp, generator_params(self.model, sp)))
        from tqdm.auto import tqdm

        pending: dict[int, _Slot] = {}
        results: list[CompletionOutput | None] = [None] * len(ids)
        try:
            for slot in slots:
                self._submit(slot, pending)
            with tqdm(total=len(ids), desc="Generating", unit="prompt", disable=not use_tqdm) as bar:
                while pending:
                    if not self.engine.has_pending_requests():
                        raise EngineError(f"the engine went idle with {len(pending)} unfinished prompts")
                    self._propose(slot.request for slot in pending.values())
                    for event in self.engine.run(self._buffer):
                        self._dispatch(event, pending, results, bar)
        finally:
            for slot in pending.values():
                slot.request.close()
        return [r for r in results if r is not None]

    def _submit(self, slot: _Slot, pending: dict[int, _Slot]) -> None:
        from pagedgen.engine.request import RequestOptions

        request = self.engine.create_request(slot.generator_params, RequestOptions())
        slot.request = request
        pending[id(request)] = slot
        request.begin_turn(slot.prompt_ids, turn_options(request, slot.params))

    def _dispatch(
        self, event: EngineEvent, pending: dict[int, _Slot], results: list[CompletionOutput | None], bar: tqdm
    ) -> None:
        from pagedgen.engine.events import EngineEventFlags

        if is_engine_failure(event.error_code):
            raise EngineError(f"the engine failed: {event.error_code.value}")
        if event.request is None:
            return  # capacity-blocked or retryable: nothing committed, the next run retries
        slot = pending[id(event.request)]
        if event.flags & EngineEventFlags.TOKEN:
            slot.tokens.append(event.token)
            if event.logprobs is not None:
                slot.logprobs.append(copy_logprobs(event.token, event.logprobs, slot.params.logprobs or 0))
        if event.flags & EngineEventFlags.TURN_FINISHED:
            results[slot.index] = self._output(slot, event)
            del pending[id(event.request)]
            if self.drafter is not None:
                self.drafter.forget(slot.request)
            slot.request.close()
            bar.update(1)

    def _output(self, slot: _Slot, event: EngineEvent) -> CompletionOutput:
        stop_reason = None
        if event.matched_stop_string_index is not None:
            stop_reason = slot.params.stop[event.matched_stop_string_index]
        usage = event.usage
        return CompletionOutput(
            index=slot.index,
            prompt=slot.prompt,
            prompt_token_ids=slot.prompt_ids,
            text=turn_text(self.tokenizer, slot.tokens, event),
            token_ids=slot.tokens,
            finish_reason=finish_reason_text(event.finish_reason),
            stop_reason=stop_reason,
            cached_prompt_tokens=usage.cached_prompt_tokens if usage is not None else 0,
            logprobs=slot.logprobs if slot.params.logprobs is not None else None,
            drafts_proposed=slot.request.drafts_proposed,
            drafts_accepted=slot.request.drafts_accepted,
        )


@dataclass(slots=True)
class TurnResult:
    """What one :meth:`ChatSession.send` produced, available once its iterator is exhausted."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    generated_tokens: int
    cached_tokens: int = 0  # conversation tokens before this turn's input that it did not recompute


class ChatSession:
    """One conversation as one multi-turn engine Request: earlier turns stay in the KV cache.

    Each turn's input is only the text the chat template adds after what the Request already holds (the end
    of the previous assistant message, the new user message and the generation prompt). When the template
    would rewrite earlier text, the session falls back to a fresh Request with the whole conversation, whose
    admission finds the unchanged prefix in the engine's prefix cache. A Request that yielded its residency
    while the user was typing (the engine needed the room) is re-admitted the same way. ``last.cached_tokens``
    says how much of the conversation the last turn did not recompute.
    """

    def __init__(self, llm: LLM, params: SamplingParams, system: str | None = None):
        self._llm = llm
        self._params = params
        self.messages: list[dict[str, str]] = (
            [] if system is None else [{"role": "system", "content": system}]
        )
        self._request: Request | None = None
        self._held_text = ""  # the text of every token the Request holds
        self._held_tokens = 0
        self.last: TurnResult | None = None

    def send(
        self, user_text: str, *, structured_outputs: StructuredOutputsParams | None = None
    ) -> Iterator[str]:
        """Stream the assistant's reply to ``user_text`` as text deltas; afterwards ``self.last`` is set.

        ``structured_outputs`` constrains this turn only (the session's ``SamplingParams`` constraint, if
        any, applies to the turns that give none). Raises ``ValueError`` (nothing changed) when the
        conversation no longer fits the context.
        """
        from pagedgen.models.tokenizer import IncrementalDetokenizer

        turn_params = self._params
        if structured_outputs is not None:
            turn_params = dataclasses.replace(self._params, structured_outputs=structured_outputs)
        messages = [*self.messages, {"role": "user", "content": user_text}]
        bound = getattr(self._llm.tokenizer, "max_token_chars", None)
        problem = check_text_fits(prompt_chars(messages), None, self._llm.context_length, bound)
        if problem is not None:  # refused before the conversation is rendered or tokenized
            raise ValueError(f"{problem} Start a new conversation.")
        prompt = self._llm.chat_prompt(messages)
        rendered = prompt.text
        ids = self._turn_input(prompt)
        if self._held_tokens + len(ids) + 1 > self._llm.context_length:
            raise ValueError(
                f"the conversation would hold {self._held_tokens + len(ids)} tokens; the context is "
                f"{self._llm.context_length}: start a new conversation"
            )
        if self._request is None:
            self._request = self._llm.engine.create_request(
                generator_params(self._llm.model, self._params), _request_options()
            )
        self._request.begin_turn(ids, turn_options(self._request, turn_params))
        detok = IncrementalDetokenizer(self._llm.tokenizer)
        tokens: list[int] = []
        event = None
        try:
            for event in self._events():
                if event.token is not None:
                    tokens.append(event.token)
                    delta = detok.add(event.token)
                    if delta:
                        yield delta
        except BaseException:  # interrupted mid-turn: the Request's state no longer matches self.messages
            self.close()
            raise
        tail = detok.flush() + event.text_before_stop  # _events ends with the TURN_FINISHED event
        if tail:
            yield tail
        self._finish_turn(messages, rendered, tokens, event)

    def _turn_input(self, prompt: ChatPrompt) -> list[int]:
        tokenizer = self._llm.tokenizer
        if self._request is not None and prompt.text.startswith(self._held_text):
            return encode_chat_prompt(tokenizer, prompt, len(self._held_text))
        self.close()
        return encode_chat_prompt(tokenizer, prompt)

    def _events(self) -> Iterator[EngineEvent]:
        from pagedgen.engine.events import EngineEventFlags

        engine = self._llm.engine
        while True:
            self._llm._propose([self._request])
            for event in engine.run(self._llm._buffer):
                if is_engine_failure(event.error_code):
                    raise EngineError(f"the engine failed: {event.error_code.value}")
                if event.request is None:
                    continue
                yield event
                if event.flags & EngineEventFlags.TURN_FINISHED:
                    return

    def _finish_turn(
        self, messages: list[dict[str, str]], rendered: str, tokens: list[int], event: EngineEvent
    ) -> None:
        reply = turn_text(self._llm.tokenizer, tokens, event)
        self.messages = [*messages, {"role": "assistant", "content": reply}]
        # A stop string's tokens stay in the Request although the reply ends before it: when the held text
        # no longer prefixes the next rendering, the next turn re-renders the conversation in a fresh Request.
        held = self._request.tokens[len(self._request.tokens) - event.usage.generated_tokens :]
        self._held_text = rendered + self._llm.tokenizer.decode(list(held))
        self._held_tokens += event.usage.prompt_tokens + event.usage.generated_tokens
        self.last = TurnResult(
            text=reply,
            token_ids=tokens,
            finish_reason=finish_reason_text(event.finish_reason),
            prompt_tokens=event.usage.prompt_tokens,
            generated_tokens=event.usage.generated_tokens,
            cached_tokens=event.usage.reused_tokens,
        )

    def close(self) -> None:
        """Release the conversation's Request (its KV blocks return to the pool)."""
        if self._request is not None:
            self._request.close()
        self._request = None
        self._held_text = ""
        self._held_tokens = 0


def _request_options() -> RequestOptions:
    from pagedgen.engine.request import RequestOptions

    return RequestOptions()
