"""A synthetic model whose greedy output is a closed formula of tokens it reads back through the block table.

It is the engine's exact oracle (docs/architecture.md, "How we know it is right"): every input it uses comes
back through the cache (the block table, the window ring with ``window``, the fixed-state bindings with
``hybrid``), so a wrong table, slot, ring or a leaked state update changes the tokens. The formula and its
variants: docs/models.md, "The synthetic oracle model".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagedgen.core.fixed_state_spec import FixedStateSpec
from pagedgen.core.kv import KVSpec, PagedKVCache
from pagedgen.core.state_manifest import SlidingWindow, StateGroup, StateKind, StateManifest
from pagedgen.core.step_inputs import StepInputs


def synthetic_next_token(first: int, prev: int, current: int, position: int, vocab_size: int) -> int:
    """The closed formula of the synthetic model's greedy next token."""
    return (first + prev + current + position) % vocab_size


def synthetic_state(tokens: Sequence[int], vocab_size: int) -> tuple[int, int]:
    """The hybrid model's fixed state ``(s0, s1)`` after ``tokens``."""
    s0 = sum((t + 1) * (p + 1) for p, t in enumerate(tokens)) % vocab_size
    return s0, len(tokens) % vocab_size


def synthetic_greedy(
    tokens: Sequence[int],
    max_new_tokens: int,
    vocab_size: int,
    eos_token_id: int | None = None,
    hybrid: bool = False,
) -> list[int]:
    """Reference greedy continuation of ``tokens`` (stops before an EOS, which is never emitted); ``hybrid``
    adds the fixed state of the hybrid model."""
    seq = list(tokens)
    out: list[int] = []
    s0, s1 = synthetic_state(seq[:-1], vocab_size) if seq else (0, 0)
    for _ in range(max_new_tokens):
        pos = len(seq) - 1
        prev = seq[pos - 1] if pos > 0 else 0
        nxt = synthetic_next_token(seq[0], prev, seq[pos], pos, vocab_size)
        s0, s1 = (s0 + (seq[pos] + 1) * (pos + 1)) % vocab_size, (s1 + 1) % vocab_size
        if hybrid:
            nxt = (nxt + s0 + s1) % vocab_size
        if eos_token_id is not None and nxt == eos_token_id:
            break
        out.append(nxt)
        seq.append(nxt)
    return out


@dataclass
class SyntheticModel:
    """Tiny, weightless, deterministic model with the same surface as :class:`pagedgen.Model`."""

    vocab_size: int = 257
    eos_token_id: int | None = None
    max_context: int = 4096
    name: str = "synthetic"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32
    window: int | None = None  # a second, sliding-window layer with this window (>= 2)
    hybrid: bool = False  # a fixed conv state too (one more layer, in its manifest's fixed_conv group)
    kv_spec: KVSpec = field(init=False)
    fixed_state_specs: tuple[FixedStateSpec, ...] = field(init=False, default=())
    state_manifest: StateManifest | None = field(init=False, default=None)  # set with hybrid

    def __post_init__(self) -> None:
        if self.vocab_size < 2 or self.vocab_size > 1 << 24:
            raise ValueError(f"vocab_size must be in [2, 2**24] (exact in float32), got {self.vocab_size}")
        if self.window is None:
            self.kv_spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=1)
        elif self.window < 2:
            raise ValueError(
                f"the synthetic model reads the previous token, so window must be >= 2, got {self.window}"
            )
        else:
            self.kv_spec = KVSpec(
                num_layers=2, num_kv_heads=1, head_dim=1, window_size=self.window, window_layers=(1,)
            )
        if self.hybrid:
            self._add_fixed_state()

    def _add_fixed_state(self) -> None:
        """One more logical layer that owns a fixed conv state row ``(s0, s1)``, declared in the manifest."""
        paged = self.kv_spec.num_layers
        self.fixed_state_specs = (FixedStateSpec("mix", StateKind.FIXED_CONV, paged, (2,)),)
        window = None if self.window is None else SlidingWindow(self.window, (1,))
        groups = (
            StateGroup(StateKind.PAGED_KV, tuple(range(paged))),
            StateGroup(StateKind.FIXED_CONV, (paged,)),
        )
        self.state_manifest = StateManifest(paged + 1, groups, window, "SyntheticModel(hybrid=True)")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return () if self.eos_token_id is None else (self.eos_token_id,)

    @property
    def runtime(self) -> SyntheticModel:
        return self

    @property
    def tokenizer(self) -> SyntheticTokenizer:
        return SyntheticTokenizer(self.vocab_size, self.eos_token_id)

    def forward(self, inputs: StepInputs, kv_cache: PagedKVCache) -> torch.Tensor:
        bs = inputs.block_size
        cache = kv_cache.keys[0].view(-1)  # [num_blocks * block_size] (1 head, head_dim 1)
        cache[inputs.slot_mapping] = inputs.input_ids.to(cache.dtype)
        row_of_token = torch.repeat_interleave(  # output_size: no device read of the lengths' sum
            torch.arange(inputs.num_seqs, device=cache.device),
            inputs.query_lens.long(),
            output_size=inputs.num_tokens,
        )  # [T]
        tables = inputs.block_tables.long()[row_of_token]  # [T, W]
        pos = inputs.positions
        first_slot = tables[:, 0] * bs
        recent, tables, base = cache, tables, torch.zeros_like(pos)
        if self.window is not None:  # previous and current tokens come from the sliding-window layer
            recent = kv_cache.keys[1].view(-1)
            ring = inputs.window
            slots = inputs.slot_mapping if ring is None else ring.slot_mapping
            recent[slots] = inputs.input_ids.to(recent.dtype)
            if ring is not None:  # the ring's rotated table starts at the row's first live block
                tables = ring.block_tables.long()[row_of_token]
                base = ring.first_pos.long()[row_of_token] // bs
        prev_pos = (pos - 1).clamp(min=0)
        prev_slot = tables.gather(1, (prev_pos // bs - base).unsqueeze(1)).squeeze(1) * bs
        cur_slot = tables.gather(1, (pos // bs - base).unsqueeze(1)).squeeze(1) * bs + pos % bs
        first = cache[first_slot].long()
        prev = torch.where(pos > 0, recent[prev_slot + prev_pos % bs].long(), torch.zeros_like(pos))
        cur = recent[cur_slot].long()
        nxt = (first + prev + cur + pos) % self.vocab_size  # [T]
        if self.hybrid:
            nxt = (nxt + self._mix(inputs, row_of_token)) % self.vocab_size
        rows = inputs.logits_rows
        logits = torch.zeros(rows.shape[0], self.vocab_size, dtype=torch.float32, device=cache.device)
        idx = torch.arange(rows.shape[0], device=cache.device)
        logits[idx, nxt[rows]] = 8.0
        logits[idx, (nxt[rows] + 1) % self.vocab_size] = 4.0
        return logits

    def _mix(self, inputs: StepInputs, row_of_token: torch.Tensor) -> torch.Tensor:
        """``s0 + s1`` after each token from each row's committed state; writes each row's last state."""
        fixed = inputs.fixed
        if fixed is None:
            raise ValueError("the hybrid synthetic model needs the step's fixed-state bindings")
        vocab = self.vocab_size
        state = fixed.inputs["mix"].long()  # [B, 2]
        pos = inputs.positions
        weight = (inputs.input_ids + 1) * (pos + 1) % vocab  # [T]
        cum = torch.cumsum(weight, 0)
        starts = inputs.cu_seqlens[:-1].long()  # [B]
        before = torch.cat([cum.new_zeros(1), cum])[starts]  # [B], the sum before each row
        local = torch.arange(pos.shape[0], device=pos.device) - starts[row_of_token]  # [T]
        s0 = (state[row_of_token, 0] + cum - before[row_of_token]) % vocab
        s1 = (state[row_of_token, 1] + local + 1) % vocab
        last = inputs.cu_seqlens[1:].long() - 1  # [B]
        fixed.outputs["mix"].copy_(torch.stack([s0[last], s1[last]], dim=1))
        return s0 + s1


class SyntheticTokenizer:
    """Printable-ASCII codec for the synthetic model: token t is the character ``chr(32 + t % 95)``.

    Lets stop strings and text deltas be tested on the synthetic model without a real vocabulary.
    """

    max_token_chars = 1  # one character per token: a text of n characters is n tokens

    def __init__(self, vocab_size: int, eos_token_id: int | None = None):
        self.vocab_size = vocab_size
        self.eos_token_ids = () if eos_token_id is None else (eos_token_id,)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """One token per character; there are no special tokens to add."""
        return [(ord(ch) - 32) % 95 % self.vocab_size for ch in text]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(
            chr(32 + t % 95) for t in token_ids if not (skip_special_tokens and t in self.eos_token_ids)
        )

    def decode_raw(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Same as ``decode``: this codec has no clean-up step that streaming must bypass."""
        return self.decode(token_ids, skip_special_tokens)
