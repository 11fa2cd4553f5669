"""A minimal paged driver over a model runtime, for model tests that must not wait for the engine.

It owns a :class:`PagedKVCache`, hands out physical blocks in a shuffled order (so a test that passes cannot
be relying on blocks being contiguous or in logical order) and runs packed steps with ``pack_step``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagedgen.core.kv import PagedKVCache
from pagedgen.executor.inputs import SequenceChunk, pack_step


@dataclass(slots=True)
class PagedSequence:
    """One request's committed tokens and its physical blocks, in logical order."""

    tokens: list[int]
    blocks: list[int] = field(default_factory=list)
    past_len: int = 0  # tokens whose K/V are in the cache


class PagedRunner:
    """Runs ``model.runtime`` over packed steps with shuffled block allocation."""

    def __init__(self, model, num_blocks: int = 256, block_size: int = 16, seed: int = 0):
        self.model = model
        self.block_size = block_size
        self.cache = PagedKVCache(model.kv_spec, num_blocks, block_size, device=model.device)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def reserve(self, seq: PagedSequence, total_tokens: int) -> None:
        need = -(-total_tokens // self.block_size) - len(seq.blocks)
        if need > len(self.free):
            raise RuntimeError(f"out of blocks: need {need}, have {len(self.free)}")
        for _ in range(need):
            seq.blocks.append(self.free.pop())

    def step(
        self,
        seqs: Sequence[PagedSequence],
        new_tokens: Sequence[Sequence[int]],
        all_logits: bool | Sequence[bool] = False,
    ) -> torch.Tensor:
        """Run one packed step; each ``seqs[i]`` gets ``new_tokens[i]`` appended. Returns float32 logits.

        ``all_logits`` (one flag, or one per sequence) asks for a logits row per new token.
        """
        flags = [all_logits] * len(seqs) if isinstance(all_logits, bool) else list(all_logits)
        chunks = []
        for seq, toks, flag in zip(seqs, new_tokens, flags, strict=True):
            self.reserve(seq, seq.past_len + len(toks))
            chunks.append(SequenceChunk(list(toks), seq.past_len, list(seq.blocks), all_logits=flag))
        inputs = pack_step(chunks, self.block_size, device=self.model.device)
        logits = self.model.runtime.forward(inputs, self.cache)
        for seq, toks in zip(seqs, new_tokens, strict=True):
            seq.tokens.extend(toks)
            seq.past_len += len(toks)
        return logits


def prompt_logits(model, ids: Sequence[int], block_size: int = 16, seed: int = 0) -> torch.Tensor:
    """Logits ``[len(ids), vocab]`` at every position of one prompt, in one prefill step."""
    runner = PagedRunner(model, num_blocks=-(-len(ids) // block_size) + 4, block_size=block_size, seed=seed)
    return runner.step([PagedSequence(tokens=[])], [list(ids)], all_logits=True)


def greedy(model, prompt: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int] = ()) -> list[int]:
    """Greedy continuation of one prompt: a prefill step, then one decode step per token."""
    runner = PagedRunner(model, num_blocks=-(-(len(prompt) + max_new_tokens) // 16) + 4)
    seq = PagedSequence(tokens=[])
    logits = runner.step([seq], [list(prompt)])
    out: list[int] = []
    while len(out) < max_new_tokens:
        token = int(logits[0].argmax())
        if token in eos_ids:
            break
        out.append(token)
        logits = runner.step([seq], [[token]])
    return out


def stepwise_logits(model, ids: Sequence[int], prefill: int, block_size: int = 4) -> torch.Tensor:
    """Logits at every position: one prefill step over ``ids[:prefill]``, then one decode step per token.

    A small block size makes the decode steps cross many (shuffled) block boundaries.
    """
    runner = PagedRunner(model, num_blocks=-(-len(ids) // block_size) + 4, block_size=block_size, seed=1)
    seq = PagedSequence(tokens=[])
    rows = [runner.step([seq], [list(ids[:prefill])], all_logits=True)]
    rows += [runner.step([seq], [[token]]) for token in ids[prefill:]]
    return torch.cat(rows)
