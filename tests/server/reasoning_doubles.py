"""A scripted synthetic model and a thinking chat template, for the reasoning tests.

The scripted model's greedy reply is a fixed text, character by character (the synthetic codec), from a
set prompt length on; past the script it answers EOS. Where a constraint masks the scripted token, greedy
sampling takes the lowest allowed token, so a constrained reply is known exactly too. The template opens
``<think>`` in the prompt when ``opens_thinking`` (DeepSeek-R1's and Qwen3.5's templates do), and closes an
empty block there when ``enable_thinking`` is false (Qwen3's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedgen.models.synthetic import SyntheticModel, SyntheticTokenizer

VOCAB = 95
EOS = 94  # "~" in the codec


@dataclass
class ScriptedModel(SyntheticModel):
    """Answers ``script`` (token ids) after a prompt of ``prompt_len`` tokens, then EOS (set both before
    a request: the worker thread reads them at each step)."""

    script: tuple[int, ...] = ()
    prompt_len: int = 0

    def forward(self, inputs, kv_cache):
        super().forward(inputs, kv_cache)  # writes the cache as the synthetic model does
        positions = inputs.positions[inputs.logits_rows].tolist()
        logits = torch.zeros(len(positions), self.vocab_size, dtype=torch.float32)  # [rows, vocab]
        for row, position in enumerate(positions):
            index = position + 1 - self.prompt_len
            token = self.script[index] if 0 <= index < len(self.script) else self.eos_token_id
            logits[row, token] = 8.0
        return logits


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


def scripted(text: str) -> tuple[int, ...]:
    return tuple(SyntheticTokenizer(VOCAB).encode(text))
