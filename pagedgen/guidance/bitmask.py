"""Token bitmasks on logits: llguidance's ``[rows, ceil(V / 32)]`` int32 masks applied as ``-inf``.

Bit ``t % 32`` of word ``t // 32`` says whether token ``t`` is allowed (little-endian, as llguidance writes
it). A mask is applied only to the logits rows it names (:class:`TokenMasks`): unguided rows and partial
prefills are never touched. Pure torch, no llguidance: the sampler applies it before every other processor.

The apply is an addition: each mask byte indexes a table of eight additive terms, ``-0.0`` for an allowed
token (``x + -0.0`` is ``x`` exactly, signed zeros included) and ``-inf`` for a forbidden one. A table
lookup and an in-place add over ``[rows, V]`` is several times faster on the CPU than unpacking bits into a
boolean mask for ``masked_fill`` (about 0.2 ms against 2.7 ms
for 16 rows of a 49k vocabulary, on two CPU threads).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

_NEG_INF = -float("inf")
_BITS = (torch.arange(256)[:, None] >> torch.arange(8)) & 1  # [256, 8], bit i of each byte value
_TERMS = torch.where(_BITS.bool(), -0.0, _NEG_INF).float()  # [256, 8], what each byte adds to 8 logits


class TokenMasks(NamedTuple):
    """The guided rows of a step's logits and their bitmasks (pass-through rows may be all ones)."""

    rows: torch.Tensor  # [G] int64, logits row of each mask (distinct)
    bitmask: torch.Tensor  # [G, ceil(V / 32)] int32


def bitmask_words(vocab_size: int) -> int:
    """Int32 words of one token bitmask row."""
    return (vocab_size + 31) // 32


def mask_terms(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[G, vocab_size]`` float32 additive terms of ``bitmask [G, W]``: -0.0 where the bit is set, -inf
    where it is clear or past ``32 * W``."""
    rows = bitmask.shape[0]
    octets = bitmask.contiguous().view(torch.uint8).long().reshape(-1)  # [4GW], byte j: tokens 8j..8j+7
    terms = _TERMS.to(bitmask.device).index_select(0, octets).reshape(rows, -1)  # [G, 32W]
    if terms.shape[1] >= vocab_size:
        return terms[:, :vocab_size]
    return torch.nn.functional.pad(terms, (0, vocab_size - terms.shape[1]), value=_NEG_INF)


def apply_token_bitmask_(logits: torch.Tensor, masks: TokenMasks) -> None:
    """Set ``logits[row, t] = -inf`` in place wherever the row's mask has bit ``t`` clear (other logits are
    unchanged, bit for bit)."""
    if masks.rows.numel() == 0:
        return
    bitmask = masks.bitmask.to(logits.device, non_blocking=True)
    terms = mask_terms(bitmask, logits.shape[1]).to(logits.dtype)  # [G, V]
    rows = masks.rows.to(logits.device)
    if rows.numel() == logits.shape[0] and bool(
        (rows == torch.arange(rows.numel(), device=rows.device)).all()
    ):
        logits.add_(terms)  # every row guided, in order: no scatter
    else:
        logits.index_add_(0, rows, terms)
