"""``tool_choice: "auto"`` on the default model (SmolLM2-135M-Instruct) through the live server.

SmolLM2's chat template has no ``tools`` variable, so the tools reach it in the fallback system prompt
(hermes format). Greedy, with one earlier turn showing a call (the 135M model does not call from the
instructions alone), it opens a call for the weather question and answers the arithmetic one in text; the
constraint makes the call's arguments valid for the schema.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.server.live import MODEL_NAME

pytestmark = pytest.mark.model

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,15}$"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": WEATHER,
        },
    }
]
SHOWN_CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Berlin", "unit": "celsius"}}\n</tool_call>'
)
CONVERSATION = [
    {"role": "user", "content": "What is the weather in Berlin?"},
    {"role": "assistant", "content": SHOWN_CALL},
    {"role": "user", "content": "What is the weather in Paris?"},
]


def ask(client, messages, **fields):
    return client.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=TOOLS, max_tokens=60, temperature=0, **fields
    )


def test_the_default_model_calls_a_tool_with_valid_arguments(client):
    choice = ask(client, CONVERSATION).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert call.function.arguments == '{"city": "Paris", "unit": "fahrenheit"}'
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    state = ChatCompletionStreamState()
    chunks = list(ask(client, CONVERSATION, stream=True))
    for chunk in chunks:
        state.handle_chunk(chunk)
    streamed = state.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (call.function.name, call.function.arguments)
    ]
    assert sum(1 for chunk in chunks if chunk.choices and chunk.choices[0].delta.tool_calls) > 3


def test_the_default_model_answers_in_text_when_no_call_is_needed(client):
    choice = ask(client, [{"role": "user", "content": "What is 2 + 2?"}]).choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content == "2 + 2 = 4"
