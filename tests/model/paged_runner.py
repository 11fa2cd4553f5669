"""A minimal paged driver over a model runtime, for model tests that must not wait for the engine.

It owns a :class:`PagedKVCache`, hands out physical blocks in a shuffled order (so a test that passes cannot
be relying on blocks being contiguous or in logical order) and runs packed steps with ``pack_step``. With
``ring_chunk`` a model's sliding-window layers keep rings (:mod:`pagedgen.core.window_geometry`) sized for
steps of at
most that many tokens per sequence, from a separate, likewise shuffled pool. A model with fixed conv /
recurrent state gets each sequence's state as its step input, and the state after the step is kept for
the next.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagedgen.core.kv import PagedKVCache
from pagedgen.core.step_inputs import FixedStateInputs
from pagedgen.core.window_geometry import ring_blocks
from pagedgen.executor.inputs import SequenceChunk, pack_step


@dataclass(slots=True)
class PagedSequence:
    """One request's committed tokens and its physical blocks, in logical order."""

    tokens: list[int]
    blocks: list[int] = field(default_factory=list)
    past_len: int = 0  # tokens whose K/V are in the cache
    ring: list[int] = field(
        default_factory=list
    )  # window ring (sliding-window layers), when the runner keeps one
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # fixed conv / recurrent state, per tensor


class PagedRunner:
    """Runs ``model.runtime`` over packed steps with shuffled block allocation."""

    def __init__(
        self, model, num_blocks: int = 256, block_size: int = 16, seed: int = 0, ring_chunk: int | None = None
    ):
        self.model = model
        self.block_size = block_size
        spec = model.kv_spec
        self.window = spec.window_size if ring_chunk is not None and spec.window_layers else None
        self.ring_blocks = 0 if self.window is None else ring_blocks(ring_chunk, self.window, block_size)
        window_blocks = None if self.window is None else 8 * self.ring_blocks
        self.cache = PagedKVCache(
            spec, num_blocks, block_size, device=model.device, window_blocks=window_blocks
        )
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.window_free = list(range(window_blocks or 0))
        random.Random(seed + 1).shuffle(self.window_free)

    def reserve(self, seq: PagedSequence, total_tokens: int) -> None:
        need = -(-total_tokens // self.block_size) - len(seq.blocks)
        if need > len(self.free):
            raise RuntimeError(f"out of blocks: need {need}, have {len(self.free)}")
        for _ in range(need):
            seq.blocks.append(self.free.pop())
        if self.window is not None and not seq.ring:
            seq.ring = [self.window_free.pop() for _ in range(self.ring_blocks)]

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
            chunks.append(
                SequenceChunk(
                    list(toks), seq.past_len, list(seq.blocks), all_logits=flag, window_ring=seq.ring
                )
            )
        inputs = pack_step(chunks, self.block_size, device=self.model.device, window=self.window)
        specs = tuple(getattr(self.model, "fixed_state_specs", ()))
        if specs:  # each sequence's fixed state in, the state after the step out (zeros to start)
            for seq in seqs:
                for s in specs:
                    seq.state.setdefault(
                        s.name, torch.zeros(s.row_shape, dtype=s.dtype, device=self.model.device)
                    )
            inputs.fixed = FixedStateInputs(
                {s.name: torch.stack([seq.state[s.name] for seq in seqs]) for s in specs},
                {s.name: torch.full((len(seqs), *s.row_shape), float("nan"), dtype=s.dtype) for s in specs},
            )
        logits = self.model.runtime.forward(inputs, self.cache)
        for i, (seq, toks) in enumerate(zip(seqs, new_tokens, strict=True)):
            seq.tokens.extend(toks)
            seq.past_len += len(toks)
            for s in specs:
                seq.state[s.name] = inputs.fixed.outputs[s.name][i].clone()
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


def chunked_logits(model, ids: Sequence[int], chunk: int, block_size: int = 4, seed: int = 2) -> torch.Tensor:
    """Logits at every position from steps of ``chunk`` tokens; windowed layers keep rings sized for them."""
    runner = PagedRunner(
        model, num_blocks=-(-len(ids) // block_size) + 4, block_size=block_size, seed=seed, ring_chunk=chunk
    )
    seq = PagedSequence(tokens=[])
    rows = [
        runner.step([seq], [list(ids[i : i + chunk])], all_logits=True) for i in range(0, len(ids), chunk)
    ]
    return torch.cat(rows)
