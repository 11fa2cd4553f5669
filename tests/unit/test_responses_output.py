"""The Responses builder's translation of chat payloads, on chat chunks given directly: reasoning, then
text, then tool calls, each its own output item, streamed one at a time with numbered events; and the
whole-turn answer built from a chat message."""

from __future__ import annotations

from pagedgen.engine.events import FinishReason
from pagedgen.errors import EngineErrorCode
from pagedgen.server.responses_api.output import ResponseBuilder
from pagedgen.server.worker import Finish

FINISH = Finish(FinishReason.EOS, 10, 4, 0, None, EngineErrorCode.NONE, reused_tokens=6)


class ChatChunks:
    """The chat builder's interface, answering the chunks (and message) it was given."""

    def __init__(self, deltas, message=None, finish_reason="stop"):
        self._deltas = list(deltas)
        self._message = message
        self._reason = finish_reason

    def first_chunk(self):
        return {"choices": [{"delta": {"role": "assistant", "content": ""}}]}

    def chunk(self, _text, _logprobs, finish_reason):
        delta = self._deltas.pop(0)
        reason = self._reason if finish_reason is not None else None
        return {"choices": [{"delta": delta, "finish_reason": reason}]}

    def full(self, _text, _logprobs, _finish_reason, _finish):
        return {"choices": [{"message": self._message, "finish_reason": self._reason}]}


def builder(chat):
    done = []
    built = ResponseBuilder(chat, {"id": "resp_x", "object": "response"}, lambda r, m: done.append((r, m)))
    built.input_tokens = 10
    return built, done


def test_reasoning_then_text_then_a_call_stream_as_three_items_in_turn():
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a"'}}
    more = {"index": 0, "function": {"arguments": ": 1}"}}
    chat = ChatChunks(
        [{"reasoning_content": "think"}, {"content": "Hi"}, {"tool_calls": [call]}, {"tool_calls": [more]}]
    )
    built, done = builder(chat)
    events = built.first_chunk()
    for index in range(4):
        events += built.chunk("", (), "stop" if index == 3 else None)
    events += built.usage_chunk(FINISH)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1, 2]
    response, message = done[0]
    reasoning, text, function = response["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [
        {"type": "reasoning_text", "text": "think"}
    ]
    assert text["content"][0]["text"] == "Hi"
    assert (function["call_id"], function["name"], function["arguments"]) == ("call_1", "f", '{"a": 1}')
    assert message == {
        "role": "assistant",
        "content": "Hi",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
        ],
    }
    assert response["usage"]["input_tokens_details"]["cached_tokens"] == 6
    assert response["usage"]["total_tokens"] == 14


def test_a_whole_turn_with_reasoning_and_no_text_still_answers_one_message():
    built, done = builder(ChatChunks([], message={"role": "assistant", "content": "", "reasoning": "hmm"}))
    response = built.full("", (), "stop", FINISH)
    assert [item["type"] for item in response["output"]] == ["reasoning", "message"]
    assert response["output"][1]["content"][0]["text"] == "" and response["status"] == "completed"
    assert done[0][1] == {"role": "assistant", "content": ""}


def test_a_cut_answer_is_incomplete():
    built, _ = builder(ChatChunks([{"content": "ab"}], finish_reason="length"))
    events = built.first_chunk() + built.chunk("ab", (), "length") + built.usage_chunk(FINISH)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-2]["item"]["status"] == "incomplete"
