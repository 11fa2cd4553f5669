"""How many of a decode's proposed drafts one step verifies: pure arithmetic, no state.

Drafts are optional work: every selected row first gets its mandatory token and its blocks, and only what is
left of the step's budget and the free blocks goes to drafts, cut where verifying them would be wasted (a
query limit, a turn's or session's remaining tokens, the table width). Kept apart from the scheduler so
the boundaries can be enumerated in unit tests; the rules: docs/engine.md, "The draft budget".
"""

from __future__ import annotations

from pagedgen.cache import blocks_for_tokens
from pagedgen.engine.request import RequestState


def outputs_left(state: RequestState) -> int:
    """Tokens the current turn can still emit before a limit ends it (the last one included)."""
    left = state.max_total_tokens - len(state.tokens)
    limit = state.turn.max_generated_tokens
    if limit:
        left = min(left, limit - state.turn_generated_tokens)
    return left


def draft_width(
    state: RequestState, budget: int, max_drafts: int, chunk_size: int | None, slot_capacity: int
) -> int:
    """How many of ``state.draft_tokens`` this step verifies.

    ``budget`` is what remains of the step's token budget, ``max_drafts`` the engine's limit, ``chunk_size``
    the per-request query limit (None: none), ``slot_capacity`` the most slots the request's table can reach
    with the blocks still free (so ``slot_capacity - seq_len`` draft positions fit).
    """
    width = min(len(state.draft_tokens), max_drafts, budget, outputs_left(state) - 1)
    if chunk_size is not None:
        width = min(width, chunk_size - 1)
    width = min(width, slot_capacity - len(state.tokens))
    return max(width, 0)


def slot_capacity(
    seq_len: int, owned_blocks: int, free_blocks: int, block_size: int, max_blocks_per_table: int | None
) -> int:
    """Slots a decode's table can reach this step: its blocks (after its mandatory token's growth) plus the
    ``free_blocks`` nobody else selected, within the supported table width."""
    width = max(owned_blocks, blocks_for_tokens(seq_len, block_size)) + free_blocks
    if max_blocks_per_table is not None:
        width = min(width, max_blocks_per_table)
    return width * block_size


def extra_blocks(seq_len: int, num_drafts: int, owned_blocks: int, block_size: int) -> int:
    """Blocks the drafts need beyond those the mandatory token already has."""
    base = max(owned_blocks, blocks_for_tokens(seq_len, block_size))
    return max(0, blocks_for_tokens(seq_len + num_drafts, block_size) - base)
