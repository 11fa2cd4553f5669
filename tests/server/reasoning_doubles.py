"""A scripted synthetic model and a thinking chat template, for the reasoning tests.

The scripted model's greedy reply is a fixed text, character by character (the synthetic codec), after a
marker (the end of the prompt); past the script it answers EOS. Where a constraint masks the scripted
token, greedy sampling takes the lowest allowed token, so a constrained reply is known exactly too. The
template opens ``<think>`` in the prompt when ``opens_thinking`` (DeepSeek-R1's and Qwen3.5's templates
do), and closes an empty block there when ``enable_thinking`` is false (Qwen3's).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from pagedgen.models.synthetic import SyntheticModel, SyntheticTokenizer

VOCAB = 95
EOS = 94  # "~" in the codec


@dataclass
class ScriptedModel(SyntheticModel):
    """Answers ``script`` (token ids) after the last ``marker`` (token ids) in its context, then EOS.

    The reply starts right after the marker (the end of the prompt a test renders), found by reading the
    row's tokens back from the KV cache, so text a server adds earlier in the prompt (a system message)
    does not shift it. Set both before a request: the worker thread reads them at each step.
    """

    script: tuple[int, ...] = ()
    marker: tuple[int, ...] = ()

    def forward(self, inputs, kv_cache):
        super().forward(inputs, kv_cache)  # writes the cache as the synthetic model does
        cache = kv_cache.keys[0].view(-1)  # [num_blocks * block_size]
        starts, size = inputs.cu_seqlens.tolist(), inputs.block_size
        rows = inputs.logits_rows.tolist()
        logits = torch.zeros(len(rows), self.vocab_size, dtype=torch.float32)  # [rows, vocab]
        for row, token_index in enumerate(rows):
            seq = bisect.bisect_right(starts, token_index) - 1
            position = int(inputs.positions[token_index])
            table = inputs.block_tables[seq].tolist()
            context = [int(cache[table[p // size] * size + p % size]) for p in range(position + 1)]
            index = len(context) - self._reply_start(context)
            logits[row, self.script[index] if index < len(self.script) else self.eos_token_id] = 8.0
        return logits

    def _reply_start(self, context: list[int]) -> int:
        width = len(self.marker)
        for end in range(len(context), width - 1, -1):
            if tuple(context[end - width : end]) == self.marker:
                return end
        return len(context) + len(self.script)  # no marker: EOS at once


class ThinkingTemplate(SyntheticTokenizer):
    """The synthetic codec with a chat template: ``role: content`` lines, then ``assistant: `` (and
    ``<think>`` when ``opens_thinking``; ``<think></think>`` when ``enable_thinking`` is false)."""

    def __init__(self, opens_thinking: bool = False):
        super().__init__(VOCAB, EOS)
        self.opens_thinking = opens_thinking

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None, **variables) -> str:
        text = "".join(f"{m['role']}: {m['content']} " for m in messages)
        if not add_generation_prompt:
            return text
        text += "assistant: "
        if variables.get("enable_thinking") is False:
            return text + "<think></think>"
        return text + ("<think>" if self.opens_thinking else "")


def encoded(text: str) -> tuple[int, ...]:
    return tuple(SyntheticTokenizer(VOCAB).encode(text))


def script_reply(model: ScriptedModel, template, messages, text: str, **variables) -> None:
    """Make ``model`` answer ``text`` to ``messages`` as ``template`` renders them (with ``variables``):
    the marker is the prompt from the last message's content on."""
    prompt = template.apply_chat_template(messages, **variables)
    model.script = encoded(text)
    model.marker = encoded(prompt[prompt.rindex(messages[-1]["content"]) :])
