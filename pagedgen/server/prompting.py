"""Chat prompts with vLLM's template options: the generation prompt, continuing the final message, and
extra template variables; a string variable holding a special-token string is refused unless the server
reads such strings as tokens (it would become control). docs/server.md, "Request parameters", has the rules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from pagedgen.llm import TextTokenizer, encode_chat_prompt
from pagedgen.models.tokenizer import ChatPrompt
from pagedgen.server.guard import ApiError

if TYPE_CHECKING:
    from pagedgen.core.json_value import JsonObject, JsonValue


def chat_prompt_ids(
    tokenizer: TextTokenizer,
    messages: Sequence[Mapping[str, JsonValue]],
    tools: list[JsonObject] | None,
    parse_special: bool,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: Mapping[str, JsonValue] | None = None,
) -> list[int]:
    """The prompt ids of a chat (call it off the event loop: templating and tokenizing can be slow); the
    messages' text is encoded as text unless ``parse_special``. A template that fails is a 400 naming
    ``messages``; a template variable that cannot be used is a 400 naming it."""
    variables = dict(template_kwargs or {})
    if not parse_special:
        _check_template_strings(tokenizer, variables)
    if tools is not None:
        variables["tools"] = tools
    try:
        generation_prompt = add_generation_prompt and not continue_final_message
        prompt = _render(tokenizer, messages, generation_prompt, parse_special, variables)
    except ValueError as exc:
        raise ApiError(400, f"cannot apply the chat template: {exc}", param="messages") from exc
    if continue_final_message:
        prompt = _cut_after_final_message(prompt, messages[-1])
    return encode_chat_prompt(tokenizer, prompt)


def _render(
    tokenizer: TextTokenizer,
    messages: Sequence[Mapping[str, JsonValue]],
    generation_prompt: bool,
    parse_special: bool,
    variables: JsonObject,
) -> ChatPrompt:
    """The rendered prompt; a tokenizer without ``render_chat`` (no special tokens to guard, e.g. the
    synthetic model's) renders with its ``apply_chat_template``."""
    if hasattr(tokenizer, "render_chat"):
        return tokenizer.render_chat(
            messages, generation_prompt, parse_special_in_content=parse_special, **variables
        )
    return ChatPrompt(
        tokenizer.apply_chat_template(list(messages), add_generation_prompt=generation_prompt, **variables)
    )


def _cut_after_final_message(prompt: ChatPrompt, final: Mapping[str, JsonValue]) -> ChatPrompt:
    content = str(final.get("content") or "").strip()
    if not content:
        raise ApiError(
            400,
            "continue_final_message needs text in the last message to continue",
            param="continue_final_message",
        )
    at = prompt.text.rfind(content)
    if at < 0:
        raise ApiError(
            400,
            "continue_final_message: the chat template does not write the last message's text as sent",
            param="continue_final_message",
        )
    end = at + len(content)
    markup = None if prompt.markup is None else tuple(span for span in prompt.markup if span[1] <= end)
    return replace(prompt, text=prompt.text[:end], markup=markup)


def _check_template_strings(tokenizer: TextTokenizer, variables: Mapping[str, JsonValue]) -> None:
    """Refuse a string variable holding a special-token string (only a tokenizer that tells text from
    control, ours, can hold one)."""
    encode = getattr(tokenizer, "encode", None)
    if encode is None or not hasattr(tokenizer, "render_chat"):
        return
    for key, value in variables.items():
        if isinstance(value, str) and encode(value) != encode(value, parse_special=False):
            raise ApiError(
                400,
                f"chat_template_kwargs.{key} holds a special-token string, which only the chat template's "
                "own markup may write",
                param=f"chat_template_kwargs.{key}",
            )
