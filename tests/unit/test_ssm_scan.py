"""The packed selective scan (Mamba-2's recurrence in chunked form) against the recurrence written per token.

Rows of different lengths (one token, shorter and longer than a chunk, exactly a chunk, none) packed in one
step, each starting from its own non-zero state, at chunk sizes from one position to more than the longest
row: every output and every row's final state equal the token-by-token recurrence of the docstring.
"""

from __future__ import annotations

import pytest
import torch

from pagedgen.ops.mixers.ssm import packed_selective_scan

HEADS, HEAD_DIM, GROUPS, STATE = 4, 3, 2, 5
LENGTHS = [1, 7, 0, 4, 11]


def reference(x, dt, a, b, c, lengths, state_in):
    """``state = exp(dt a) state + dt x B^T``, ``y = state C``, token by token, row by row."""
    per_group = HEADS // GROUPS
    y, states, t = torch.zeros_like(x), state_in.clone(), 0
    for row, length in enumerate(lengths):
        state = state_in[row].clone()  # [H, P, N]
        for _ in range(length):
            bh = b[t].repeat_interleave(per_group, dim=0)  # [H, N]
            ch = c[t].repeat_interleave(per_group, dim=0)
            state = (
                torch.exp(dt[t] * a)[:, None, None] * state + (dt[t][:, None] * x[t])[..., None] * bh[:, None]
            )
            y[t] = (state @ ch[..., None]).squeeze(-1)
            t += 1
        states[row] = state
    return y, states


@pytest.mark.parametrize("host_copy", [False, True])
@pytest.mark.parametrize("chunk", [1, 3, 4, 64])
def test_the_chunked_scan_equals_the_recurrence_for_every_row(chunk, host_copy):
    gen = torch.Generator().manual_seed(0)
    tokens = sum(LENGTHS)
    x = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen)
    dt = torch.rand(tokens, HEADS, generator=gen) * 0.5
    a = -torch.rand(HEADS, generator=gen) * 3
    b = torch.randn(tokens, GROUPS, STATE, generator=gen)
    c = torch.randn(tokens, GROUPS, STATE, generator=gen)
    state_in = torch.randn(len(LENGTHS), HEADS, HEAD_DIM, STATE, generator=gen)
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    before = state_in.clone()
    state_out = torch.full_like(state_in, float("nan"))
    host = cu_seqlens.clone() if host_copy else None  # the scan then plans its chunks from the host copy
    y = packed_selective_scan(
        x, dt, a, b, c, cu_seqlens, state_in, state_out, chunk=chunk, host_cu_seqlens=host
    )
    want_y, want_states = reference(x, dt, a, b, c, LENGTHS, state_in)
    assert (y - want_y).abs().max().item() < 1e-5
    assert (state_out - want_states).abs().max().item() < 1e-5
    assert torch.equal(state_in, before)  # the committed state is read, never written
