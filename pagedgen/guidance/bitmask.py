"""Token bitmasks on logits: llguidance's ``[rows, ceil(V / 32)]`` int32 masks applied as ``-inf``.

Bit ``t % 32`` of word ``t // 32`` says whether token ``t`` is allowed (little-endian, as llguidance writes
it). A mask is applied only to the logits rows it names (:class:`TokenMasks`): unguided rows and partial
prefills are never touched. Pure torch, no llguidance: the sampler applies it before every other processor.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

_NEG_INF = -float("inf")


class TokenMasks(NamedTuple):
    """The guided rows of a step's logits and their bitmasks (pass-through rows may be all ones)."""

    rows: torch.Tensor  # [G] int64, logits row of each mask
    bitmask: torch.Tensor  # [G, ceil(V / 32)] int32


def bitmask_words(vocab_size: int) -> int:
    """Int32 words of one token bitmask row."""
    return (vocab_size + 31) // 32


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Unpack ``bitmask [G, W]`` int32 to ``[G, vocab_size]`` bool; tokens past ``32 * W`` are not allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [G, W, 32]
    allowed = bits.reshape(bitmask.shape[0], -1).bool()  # [G, 32 * W]
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    return torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]))


def apply_token_bitmask_(logits: torch.Tensor, masks: TokenMasks) -> None:
    """Set ``logits[row, t] = -inf`` in place wherever the row's mask has bit ``t`` clear."""
    if masks.rows.numel() == 0:
        return
    rows = masks.rows.to(logits.device)
    allowed = allowed_tokens(masks.bitmask.to(logits.device, non_blocking=True), logits.shape[1])  # [G, V]
    logits[rows] = logits[rows].masked_fill(~allowed, _NEG_INF)
